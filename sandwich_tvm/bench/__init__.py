"""The benchmark harness, beside the product: ``python -m sandwich_tvm.bench gemm|e2e|serve|...``.

It times Sandwich against its baselines (numpy/torch GEMMs, HF transformers, llama.cpp,
llama-server, TVM's stock build) on the same weights and threads. The product (``serve``,
``generate``, ``compile``, ``tune``, the runtime and the kernels) never imports this package.
"""
