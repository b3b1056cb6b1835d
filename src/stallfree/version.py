"""The package's version: a leaf module, so that every layer can name it without importing the
package's public API (stallfree/__init__.py), which reaches back into every layer."""

__version__ = "0.4.0"
