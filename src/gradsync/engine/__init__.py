"""The engine: gradients in, averaged gradients out, bucket by bucket.

Bucket assignment (``buckets``), bucket storage (``grad_bucket``, ``bucket_set``), the reducer
and its lifecycle (``reducer``), launching buckets in order (``launch``), the one-time rebuild
(``rebuild``) and the fault-tolerant reduction (``tolerant``). It knows nothing of the
``nn.Module`` wrapper above it, nor of torch's private names (``gradsync.compat``).
"""
