"""The engine: gradients in, averaged gradients out, bucket by bucket.

``reducer`` (the lifecycle, and the parts it holds), ``buckets`` (pure assignment), ``storage`` and
``bucket_set`` (flat buffers, copying in and out), ``grad_bucket`` (what comm hooks receive),
``reductions`` (all-reduce, comm hook), ``backward_pass``, ``usage``, ``static_graph``,
``rebuild``, ``divisor``, ``records``, ``tolerance`` (the fault-tolerant side), ``fused_optim``,
``streams`` (on CUDA: a bucket's launch waits for the streams that produced its gradients).
It knows nothing of the ``nn.Module`` wrapper above it, nor of torch's private names
(``gradsync.compat`` translates them).
"""
