"""stack_to_cat: ``stack(xs, d)`` -> ``cat([unsqueeze(x, d) for x in xs], d)``.

Why: ``stack`` is on no accelerator's operator list, while ``unsqueeze`` and ``cat`` are on all
of them. Interleaved rotary embeddings (GPT-J, CodeGen, Cohere, GLM, Helium) stack the two
rotated halves in every layer, so the one op split each layer's region in three.

Exact: it is the definition of ``stack``. Always fires (static or symbolic shapes).
"""

from __future__ import annotations

from fxpass import rule
from fxpass.rules._util import aten


@rule(aten.stack.default, name="stack_to_cat")
def stack_to_cat(node, rw) -> bool:
    """stack -> cat of unsqueezed inputs (the dim counts in the output's rank)."""
    xs = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= rw.val(node).dim()
    parts = [rw.call(aten.unsqueeze.default, x, dim) for x in xs]
    rw.replace(node, rw.call(aten.cat.default, parts, dim))
    return True
