"""The command-line tools turn on jax's persistent compilation cache by default; tests keep it off
(set it per test where a test is about it), so they never read or write a user's cache."""

import os

os.environ.setdefault("MLA_JAX_COMPILE_CACHE", "off")
