"""Backend dispatch shared by the kernels of this package.

Every public kernel entry point takes ``impl`` in {None, "kernel", "interpret", "reference"}:

* ``None``: the Mosaic GPU kernel when the default backend is a Hopper GPU (compute
  capability 9.x), the plain-jnp reference everywhere else.
* ``"kernel"``: force the Mosaic GPU kernel (also what cross-lowering for ``cuda`` on a CPU
  host uses: the kernel is only traced and lowered there, never run).
* ``"interpret"``: run the kernel under the Pallas Mosaic GPU interpreter (CPU; slow; some
  production constructs have interpretable stand-ins, see the kernel modules).
* ``"reference"``: force the plain-jnp reference.
"""

from __future__ import annotations

import functools

import jax

IMPLS = (None, "kernel", "interpret", "reference")


@functools.cache
def default_backend_is_hopper() -> bool:
    """True when jax's default backend is a CUDA GPU of compute capability 9.x."""
    try:
        if jax.default_backend() != "gpu":
            return False
        device = jax.devices()[0]
    except RuntimeError:  # no backend initialised at all
        return False
    capability = getattr(device, "compute_capability", "")
    return str(capability).split(".")[0] == "9"


def resolve_impl(impl: str | None) -> str:
    """Maps the user's ``impl`` argument to one of "kernel", "interpret", "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl is None:
        return "kernel" if default_backend_is_hopper() else "reference"
    return impl
