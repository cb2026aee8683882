"""The package version (a leaf: what a checkpoint manifest records, without importing the package's
import hook)."""
__version__ = "0.1.0"
