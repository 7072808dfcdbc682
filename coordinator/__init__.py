"""The coordinator: request queue, continuous batching, the round loop, stop conditions, streaming."""

# The `specdec` facade imports LocalEngine, which imports this package. Loading the facade first
# makes every import order resolve the same way: library, then workers and coordinator, then
# specdec.app. Without it, importing a module of this package first would find itself
# half-initialised when the facade reaches back for it.
import specdec  # noqa: E402, F401
