"""The data stages' outputs as MLflow datasets: metadata only (where an output lives, its digest,
its size in tokens), never the data. MLflow's own source types where it has one (local, s3,
http...), and an fsspec one for the other URLs, registered so that MLflow reads it back."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import register_dataset_source, resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.exceptions import MlflowException

from mllm import storage

MAX_DIGEST = 36  # the datasets table's digest column


class StorageDatasetSource(DatasetSource):
    """Any fsspec URL that MLflow has no source type for (memory://, gcs://, ...)."""

    def __init__(self, uri: str):
        self.uri = uri

    @staticmethod
    def _get_source_type() -> str:
        return "fsspec"

    def load(self, dst_path=None) -> str:
        dst = os.path.join(dst_path or tempfile.mkdtemp(), os.path.basename(self.uri.rstrip("/")))
        storage.filesystem(self.uri)[0].get(storage.filesystem(self.uri)[1], dst, recursive=True)
        return dst

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False  # never chosen over MLflow's own types; registered only to be read back

    @classmethod
    def _resolve(cls, raw_source: Any) -> "StorageDatasetSource":
        return cls(raw_source)

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> "StorageDatasetSource":
        return cls(source_dict["uri"])


register_dataset_source(StorageDatasetSource)


class TokenDataset(MetaDataset):
    """Metadata only: where a data stage's output lives, its digest and its size in tokens."""

    def __init__(self, source: DatasetSource, name: str, digest: str, n_tokens: int | None):
        self.n_tokens = n_tokens
        super().__init__(source=source, name=name, digest=digest)

    @property
    def profile(self) -> dict[str, int] | None:
        return {"num_tokens": self.n_tokens} if self.n_tokens is not None else None

    def to_dict(self) -> dict[str, str]:
        d = super().to_dict()
        if self.profile:
            d["profile"] = json.dumps(self.profile)
        return d


def dataset_source(uri: str) -> DatasetSource:
    """MLflow's own source type where it has one (local, s3, http...), else ours."""
    with warnings.catch_warnings():
        # "can be interpreted in multiple ways": MLflow registers local paths twice itself.
        warnings.simplefilter("ignore", UserWarning)
        try:
            return resolve_dataset_source(uri)
        except MlflowException:
            return StorageDatasetSource(uri)
