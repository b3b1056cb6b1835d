"""stallfree: train PyTorch image classifiers without data stalls."""

__version__ = "0.3.0"
