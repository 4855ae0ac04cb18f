"""The weights as an engine's step reads them, and the way back to the model's layout.

The model's own layout (pagedjax.model.llama) stacks each weight over the layers, `[in, out]`. On
the native CPU path a step holds them otherwise:
- unstacked, projections `[out, in]` (`unstack_layers`): XLA:CPU would copy a stacked weight's
  slice before every matmul;
- and, where the native matmul runs (a CPU with AVX-512, or AVX2 and FMA:
  `pagedjax.native.matmul_available`), every projection and the output head as
  `pagedjax.native.Panels`, multiplied by that kernel: a few
  rows times a large weight run at the memory's rate on every core, and each row's result does
  not depend on the rows beside it. The head is then a second copy of a tied embedding, under
  "head" (the embedding itself stays for the token lookup). A weight whose values are exactly
  those of a 4-bit, 8-bit or bfloat16 block form is packed in it (a GGUF checkpoint's Q4_1
  projections and Q8_0 embedding, dequantized on loading: SmolLM2-135M's panels take 112 MB
  instead of 538 MB), and multiplies to the same float32 result from fewer bytes.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax import native
from pagedjax.model.llama import stack_layers, unstack_layers

_SHARED: dict[tuple, tuple[list, Any]] = {}


def to_step_layout(params: Any, *, unstacked: bool, panels: bool) -> dict[str, Any]:
    """`params` (the model's layout) as a step reads them: unstacked, and the projections and
    head as Panels (panels=True needs unstacked=True)."""
    params = unstack_layers(params) if unstacked else dict(params)
    if panels:
        as_panels = lambda w: native.Panels.from_out_in(w) if w.ndim == 2 else w  # noqa: E731
        params["layers"] = tuple({name: as_panels(w) for name, w in lp.items()} for lp in params["layers"])
        head = params["lm_head"].T if "lm_head" in params else params["embed_tokens"]
        params["head"] = native.Panels.from_out_in(head)
    return params


def from_step_layout(params: Any) -> dict[str, Any]:
    """The inverse of `to_step_layout`: the model's layout (copies where it differs)."""
    params = dict(params)
    params.pop("head", None)
    if isinstance(params["layers"], (list, tuple)):
        params["layers"] = tuple({name: w.to_out_in() if isinstance(w, native.Panels) else w for name, w in lp.items()}
                                 for lp in params["layers"])
    return stack_layers(params)


def _layout_once(params, layout: dict):
    """to_step_layout(params, **layout), once per set of loaded weights: engines built on one
    loaded model (a benchmark's systems, a block-size sweep) share one copy, which lives as long
    as the loaded weights do."""
    leaves = jax.tree.leaves(params)
    key = (*map(id, leaves), *layout.values())
    hit = _SHARED.get(key)
    if hit is not None and all(ref() is leaf for ref, leaf in zip(hit[0], leaves)):
        return hit[1]
    _SHARED[key] = ([weakref.ref(leaf) for leaf in leaves], to_step_layout(params, **layout))
    weakref.finalize(leaves[0], _SHARED.pop, key, None)
    return _SHARED[key][1]


class StepWeights:
    """`arrays`: the weights as the step reads them; `params`: in the model's layout.
    unstacked: the step runs the layers unstacked (the native CPU path); the native matmul then
    takes the projections where it runs and the model is float32."""

    def __init__(self, params: Any, *, unstacked: bool):
        float32 = params["norm"].dtype == jnp.float32
        self.layout = {"unstacked": unstacked, "panels": unstacked and float32 and native.matmul_available()}
        self.arrays = _layout_once(params, self.layout) if unstacked else params

    @property
    def params(self) -> Any:
        """The weights in the model's layout: a copy where `arrays` hold them otherwise."""
        return from_step_layout(self.arrays) if self.layout["unstacked"] else self.arrays

    def replace(self, params: Any) -> None:
        """Hold `params` (the model's layout) from now on, in this layout."""
        self.arrays = to_step_layout(params, **self.layout) if self.layout["unstacked"] else params
