"""What a pack records of the process: environment variables (filtered) and installed package versions.

Only variables that change numerics or communication are kept (ENV_ALLOW); run-specific ones that differ
between two launches of the same job (ports, ranks, run ids, output paths) are dropped (ENV_DENY), and a
name that looks like a secret (SECRET_MARKERS) is never written, whatever the lists say.
"""
from __future__ import annotations

import fnmatch
import importlib.metadata
import os
from typing import Mapping, Optional

# Prefixes and names whose values can change a job's numerics, kernels or communication.
ENV_ALLOW: tuple[str, ...] = (
    "CUDA_*", "CUBLAS_*", "CUDNN_*", "NCCL_*", "TORCH_*", "PYTORCH_*", "OMP_*", "MKL_*", "OPENBLAS_*",
    "KMP_*", "GOMP_*", "NVTE_*", "DS_*", "DEEPSPEED_*", "MEGATRON_*", "HCCL_*", "ASCEND_*", "XLA_*", "HIP_*",
    "ROCM_*", "HSA_*", "CCL_*", "ONEAPI_*", "HF_*", "TRANSFORMERS_*", "ACCELERATE_*", "TOKENIZERS_*",
    "PYTHONHASHSEED", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NVIDIA_TF32_OVERRIDE", "DYNAMIC_MONITOR",
)
# Run-specific: they differ between two launches of one job without changing it.
ENV_DENY: tuple[str, ...] = (
    "MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_*", "TORCH_ELASTIC_*", "*_RUN_ID", "RANK", "LOCAL_RANK",
    "GROUP_RANK", "ROLE_RANK", "*_DIR", "*_PATH", "*_FILE",
)
# Never written: a variable whose name contains one of these (case-insensitive).
SECRET_MARKERS: tuple[str, ...] = ("TOKEN", "KEY", "PASSWORD", "SECRET", "CREDENTIAL", "PASSWD")


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def filtered_environment(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables of `environ` (default: this process's) that ENV_ALLOW keeps, minus ENV_DENY and secrets."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items())
            if _matches(name, ENV_ALLOW) and not _matches(name, ENV_DENY) and not is_secret(name)}


def package_versions() -> dict[str, str]:
    """{distribution name (lower case): version} of every installed Python package."""
    versions = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            versions[name.lower()] = dist.version
    return dict(sorted(versions.items()))
