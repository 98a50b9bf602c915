"""The object store on S3 (AWS, MinIO, any S3 endpoint) through botocore, with boto3's transfer
manager (s3transfer) for the streamed uploads and downloads of files.

The client is botocore's own (what boto3.client makes, less boto3's injected methods): boto3 and
s3transfer load only with a file's first transfer, not when a runtime process starts, whose
request waits for it (about 0.1 s of a cold start).

botocore's standard retry mode retries what is transient (connection errors, 5xx, throttling)
with backoff; what still fails is translated here into our errors: a missing key is NotFound,
anything else Unreachable, naming the endpoint and bucket.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from cloud.errors import NotFound, Unreachable
from cloud.settings import Settings

# attempts per request, the first included; standard mode backs off up to 20 s between them
_MAX_ATTEMPTS = 4
# a dead endpoint fails within seconds instead of botocore's default minute per attempt
_CONNECT_TIMEOUT_S = 5.0
# what S3 answers for a missing key or bucket, by operation
_MISSING = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
# what it answers for credentials it does not accept
_REFUSED = frozenset({"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})


class S3ObjectStore:
    """Objects as keys of one bucket; keys are the same as the local store's file paths."""

    def __init__(self, client: Any, bucket: str, endpoint: str) -> None:
        self.client = client
        self.bucket = bucket
        # where, in every error message: the endpoint and bucket an operator would check
        self._where = f"bucket {bucket!r} at {endpoint}"

    @classmethod
    def from_settings(cls, settings: Settings) -> S3ObjectStore:
        """A client for the configured endpoint, with the bucket created when missing."""
        endpoint = settings.s3_endpoint_url or None
        config = Config(
            region_name=settings.s3_region,
            retries={"mode": "standard", "max_attempts": _MAX_ATTEMPTS},
            connect_timeout=_CONNECT_TIMEOUT_S,
            # MinIO and other self-hosted endpoints serve buckets as paths, not subdomains
            s3={"addressing_style": "path" if endpoint else "auto"},
        )
        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=settings.s3_access_key_id or None,
            aws_secret_access_key=settings.s3_secret_access_key.get_secret_value() or None,
            config=config,
        )
        store = cls(client, settings.s3_bucket, endpoint or f"AWS S3 ({settings.s3_region})")
        store.ensure_bucket(settings.s3_region)
        return store

    def ensure_bucket(self, region: str) -> None:
        try:
            with self._translated("check"):
                self.client.head_bucket(Bucket=self.bucket)
            return
        except NotFound:
            pass
        # us-east-1 is the one region S3 refuses as an explicit location constraint
        constraint = {"CreateBucketConfiguration": {"LocationConstraint": region}}
        location = {} if region == "us-east-1" else constraint
        with self._translated("create"):
            try:
                self.client.create_bucket(Bucket=self.bucket, **location)
            except ClientError as exc:
                if _error_code(exc) != "BucketAlreadyOwnedByYou":  # else another process created it first
                    raise

    def put(self, key: str, data: bytes) -> None:
        with self._translated(f"store {key!r} in"):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_file(self, key: str, path: Path) -> None:
        # upload_file streams from disk, in parallel multipart parts above 8 MiB
        with self._translated(f"store {key!r} in"), _transfer(self.client) as transfer:
            transfer.upload_file(str(path), self.bucket, key)

    def get(self, key: str) -> bytes:
        with self._translated(f"read {key!r} from"):
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def get_file(self, key: str, path: Path) -> None:
        # download_file streams to disk, in parallel ranged parts above 8 MiB
        with self._translated(f"read {key!r} from"), _transfer(self.client) as transfer:
            transfer.download_file(self.bucket, key, str(path))

    def exists(self, key: str) -> bool:
        try:
            with self._translated(f"look up {key!r} in"):
                self.client.head_object(Bucket=self.bucket, Key=key)
        except NotFound:
            return False
        return True

    def delete_prefix(self, prefix: str) -> None:
        """The key `prefix` and every key under `prefix/`, as the local store deletes a file or
        a folder: a page of the listing at a time, each page (at most 1000 keys, what one
        DeleteObjects call takes) deleted in one call."""
        folder = prefix.rstrip("/") + "/"
        with self._translated(f"delete {prefix!r} from"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                keys = [item["Key"] for item in page.get("Contents", [])]
                self._delete([key for key in keys if key == prefix or key.startswith(folder)])

    def _delete(self, keys: list[str]) -> None:
        if not keys:
            return
        objects = [{"Key": key} for key in keys]
        answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
        if errors := answer.get("Errors"):
            first = errors[0]
            raise Unreachable(
                f"object store: cannot delete {len(errors)} objects from {self._where}, "
                f"{first.get('Key')!r} first: {first.get('Code')} {first.get('Message')}"
            )

    @contextmanager
    def _translated(self, action: str) -> Iterator[None]:
        """boto3's errors, once its retries are spent, as ours (NotFound or Unreachable)."""
        try:
            yield
        except ClientError as exc:
            code = _error_code(exc)
            failed = f"object store: cannot {action} {self._where}: {code}"
            if code in _MISSING:
                raise NotFound(failed) from None
            message = exc.response.get("Error", {}).get("Message")
            hint = (
                "; check LUMINAL_S3_ACCESS_KEY_ID and LUMINAL_S3_SECRET_ACCESS_KEY"
                if code in _REFUSED
                else ""
            )
            raise Unreachable(f"{failed} {message or ''}".rstrip() + hint) from None
        except (BotoCoreError, *_transfer_errors()) as exc:
            raise Unreachable(f"object store: cannot {action} {self._where}: {exc}") from None


def _transfer(client: Any):
    """boto3's transfer manager on the client, as boto3's injected upload_file and download_file
    make it (default TransferConfig)."""
    from boto3.s3.transfer import S3Transfer

    return S3Transfer(client)


def _transfer_errors() -> tuple[type[Exception], ...]:
    """What boto3's transfers raise once their retries are spent; none where no transfer ran (a
    process that never imported boto3 cannot have raised them)."""
    errors = sys.modules.get("boto3.exceptions")
    if errors is None:
        return ()
    return (errors.S3UploadFailedError, errors.S3TransferFailedError, errors.RetriesExceededError)


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", "unknown"))
