"""Integrations: torch.distributed agreement (distributed.py), Lightning and transformers callbacks."""
