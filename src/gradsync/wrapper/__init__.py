"""The ``nn.Module`` wrapper's parts: constructor arguments, what is synchronised, uneven inputs.

``gradsync.ddp`` assembles them into ``DistributedDataParallel``.
"""
