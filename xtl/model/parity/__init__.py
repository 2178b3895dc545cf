"""Runtime parity with transformers: run an xtl model and transformers' eager model on the same tokens, compare.

The engine behind the ``HFParityCheck`` callback and ``xtl check-parity`` (it imports no Lightning). The reference
is transformers' own model class for the config (eager attention, eager experts), loaded through transformers'
own loader (``from_pretrained``) from an HF directory or from the xtl model's current weights mapped through its
HF key map; for a vision-language model (Qwen3-VL, Qwen3-VL-MoE) the image-text-to-text class
(``Qwen3VLForConditionalGeneration``). Both models run on the same documents (with their images), each document on
its own for the reference (positions restart at 0), and the report compares, row by row:

- for a vision-language model, ``vision patch_embed``, ``vision block 0`` ..., ``vision merger`` and ``vision
  deepstack 0`` ...: the vision tower's outputs on the documents' images (a probe image when they have none);
- ``embed``, ``layer 0`` ... ``layer L-1``, ``norm``: hidden states after the embedding, every decoder layer and
  the final norm (forward hooks);
- ``logits`` and ``loss`` (the cross-entropy over the supervised tokens of all documents);
- ``grad <name>``: gradients of the loss for a set of xtl parameters (default: first and last decoder layer,
  final norm, head; for a vision-language model also the first vision block and the patch merger).

A row's error is the relative L2 error ``||x - ref|| / ||ref||`` (the absolute difference for the loss); it
passes when the tensors are equal or the error is within the bound of the tolerance preset (a bound of 0 asks
for bitwise equality). The first failing row, in the order above, is the first diverging layer.

Two modes:

- ``hf_impl``: the xtl model runs under :func:`xtl.ops.hf_impl` (every op selector returns transformers' exact
  op) with the same call shapes as the reference (one HF-style call per document), so the bound is 0.
- ``fast``: the xtl model runs as training runs it (the run's own ops, the packed micro-batch, the fused chunked
  loss), compared with the bounds of the compute dtype.

Every rank of a distributed run calls :func:`run_parity_check` with the same documents (sharded parameters and
gradients are gathered one tensor at a time); only rank 0 builds and runs the reference and gets the report.

- :mod:`~xtl.model.parity.presets`: :data:`PARITY_MODES`, :class:`ParityTolerance`, the :data:`TOLERANCES`
  presets and :func:`resolve_tolerance`.
- :mod:`~xtl.model.parity.documents`: :class:`ParityDocuments` (and :class:`DocumentImages`), the input.
- :mod:`~xtl.model.parity.reference`: :func:`load_reference`, :func:`build_reference`,
  :func:`truncated_hf_config`.
- :mod:`~xtl.model.parity.compare`: running both sides (forward hooks, loss, gradients) and comparing them.
- :mod:`~xtl.model.parity.report`: :class:`ParityRow`, :class:`ParityReport`, :class:`ParityCheckError`.
- :mod:`~xtl.model.parity.check`: :func:`run_parity_check`, :func:`default_grad_params`.
"""

from xtl.model.parity.check import default_grad_params, run_parity_check
from xtl.model.parity.documents import DocumentImages, ParityDocuments
from xtl.model.parity.presets import PARITY_MODES, TOLERANCES, ParityTolerance, resolve_tolerance
from xtl.model.parity.reference import build_reference, load_reference, truncated_hf_config
from xtl.model.parity.report import ParityCheckError, ParityReport, ParityRow

__all__ = [
    "PARITY_MODES",
    "TOLERANCES",
    "DocumentImages",
    "ParityCheckError",
    "ParityDocuments",
    "ParityReport",
    "ParityRow",
    "ParityTolerance",
    "build_reference",
    "default_grad_params",
    "load_reference",
    "resolve_tolerance",
    "run_parity_check",
    "truncated_hf_config",
]
