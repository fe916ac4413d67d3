"""CPU stand-ins for the GPU kernel entry points the ``flash_attn`` and ``torch_cuda`` adapters call.

* :mod:`.varlen_kernel`: FlashAttention-2's varlen forward and backward as the GPU runs them, in
  float64 (what rows are computed, how rows without a key are marked, the LSE layouts, what is
  refused).
* :mod:`.flash_attn_pkg`: fake ``flash_attn`` packages of three API generations (2.5.x, 2.6.x,
  2.7/2.8.x with ``torch.library.custom_op``), built by :func:`make_flash_attn`.
* :mod:`.aten_flash`: ``_flash_attention_forward/_backward`` operators with PyTorch's 2.3-era and
  current schemas, built by :func:`make_aten_flash`.
"""

from standins.aten_flash import make_aten_flash
from standins.flash_attn_pkg import make_flash_attn

__all__ = ["make_aten_flash", "make_flash_attn"]
