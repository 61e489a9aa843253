"""The ``nn.Module`` wrapper in gradsync's terms (``data_parallel``) and its parts: constructor
options, what is synchronised, the parameter guard, uneven inputs, mixed precision, bucket caps.

``gradsync.ddp`` adds torch's type and private names to it: ``DistributedDataParallel``.
"""
