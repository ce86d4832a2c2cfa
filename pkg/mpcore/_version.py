"""mpcore's version, written here only: pyproject.toml reads it when the
package is built, and mpcore.__version__ is this."""
__version__ = "0.1.0"
