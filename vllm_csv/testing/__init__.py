"""Test and benchmark harness: what ``tests/`` and ``benchmarks/`` both import, by name.

Not part of the public API (:class:`~vllm_csv.CertifiedHead`, :class:`~vllm_csv.HeadConfig`,
the CLI and the serving flags are); nothing in the product imports it. Its modules:

================== =========================================================================
module             what it holds
================== =========================================================================
``threads``        the thread count tests and small benchmarks run with
``heads``          synthetic heads (peaked, learned-like) and the hidden states near their rows
``exact``          the dense reference top-k and bit-for-bit comparison
``fakes``          vLLM pieces built without vLLM's config: processors, the plugin's layer,
                   a clock
``audit``          the adversarial audit of the certificate: hostile head families and checks
``audit_sampler``  the adversarial audit of the sampler path (vLLM's own ``Sampler``)
``fixtures``       learned-head fixtures: small Llama-style models trained here, cached
``tail_bound``     the dimension-wise tail bound's surviving tokens
``vllm_v2``        vLLM V2's Triton sampling kernels, loaded from the installed vLLM or a copy
``load_bench``     the load benchmark's clients, schedule and report
``serve_bench``    the serving benchmark's server pairs, rounds and report
``row_walk``       the modules a row certified in vLLM's sampler walks through, by phase
================== =========================================================================

Import the modules themselves (``from vllm_csv.testing import audit``); this package imports
none of them, so that importing one does not pull in torch, vLLM or Triton for another.
"""
