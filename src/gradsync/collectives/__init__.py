"""Collectives gradsync issues outside the per-bucket reduction, over public ``torch.distributed`` only."""
