"""What gradsync asks of CUDA itself, below every other layer: which stream is current, cheaply."""
