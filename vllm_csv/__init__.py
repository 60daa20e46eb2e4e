"""vllm-csv: certified sub-vocabulary decoding (CSV-Decode) for vLLM's LM head."""

__version__ = "0.1.0"

from .errors import CSVError  # noqa: E402
from .head import CertifiedHead, HeadConfig, StepStats, TopKResult  # noqa: E402
from .index import CSVIndex, build_index, fingerprint_weights  # noqa: E402

__all__ = ["CSVError", "CSVIndex", "CertifiedHead", "HeadConfig", "StepStats", "TopKResult",
           "build_index", "fingerprint_weights", "__version__"]
