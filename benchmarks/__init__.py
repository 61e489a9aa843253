"""gradsync's benchmarks: ``python -m benchmarks`` lists the studies, ``python -m benchmarks STUDY`` runs one.

``lib/`` holds what the studies share (timing, workloads, contenders, the shaped link, ...);
``studies/`` one module per study. See benchmarks/README.md.
"""
