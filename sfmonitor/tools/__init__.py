"""Tools around a run: the HTML report (``sfmonitor report``), LR range test, plateau detection."""
