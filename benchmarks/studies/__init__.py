"""One module per study; ``python -m benchmarks`` lists them and runs one (``benchmarks/__main__.py``)."""
