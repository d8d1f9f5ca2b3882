"""EXL3 (ExLlamaV3's trellis-coded weights): format, reference decoder, linear method.

``weight.py`` (the per-projection tensors, checked), ``codebook.py`` (state -> value),
``hadamard.py`` (the 128-point transform), ``reference.py`` (the pure-PyTorch decoder
and forward: the CPU path and every kernel's oracle), ``method.py`` (the
``LinearMethod`` and the kernel hook), ``loading.py`` (what ``--quantization`` /
``--bits`` select, random EXL3 weights for ``dummy:`` models); the quantizer:
``quantize.py`` (layer by layer over calibration text, resumable), ``quantize_linear.py``
(Hessian, rotation, LDLQ), ``viterbi.py`` (tail-biting trellis search), ``quantize_io.py``
(ExLlamaV3's directory layout), ``quantize_cli.py`` (``trellm quantize``). docs/architecture.md
describes the format and the design.
"""
