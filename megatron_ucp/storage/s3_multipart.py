"""Incomplete multipart uploads: S3's ListMultipartUploads / AbortMultipartUpload, which obstore
does not expose, signed here with AWS Signature V4 (a killed writer's parts are billed until
aborted)."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from megatron_ucp.errors import UCPError
from megatron_ucp.storage.object_store import SCHEMES, ObjectPath, store_error


def _s3_request(path: ObjectPath, method: str, key: str, query: dict[str, str]) -> bytes:
    """One AWS Signature V4 signed request to the bucket (ListMultipartUploads, AbortMultipartUpload)."""
    endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or f"https://s3.{os.environ.get('AWS_REGION', 'us-east-1')}.amazonaws.com")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        raise UCPError(f"{path}: listing incomplete uploads needs AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY in the environment")
    u = urllib.parse.urlsplit(endpoint)
    resource = "/" + urllib.parse.quote(f"{path.bucket}/{key}" if key else path.bucket, safe="/-_.~")
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    q = "&".join(f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
                 for k, v in sorted(query.items()))
    payload = hashlib.sha256(b"").hexdigest()
    headers = {"host": u.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp}
    if os.environ.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = os.environ["AWS_SESSION_TOKEN"]
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, resource, q, "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
                           signed, payload])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={signed}, "
                                f"Signature={signature}")
    req = urllib.request.Request(f"{u.scheme}://{u.netloc}{resource}?{q}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise store_error(path, f"{method} ?{'&'.join(query)}", e) from None


@dataclass(frozen=True)
class IncompleteUpload:
    path: ObjectPath
    upload_id: str
    initiated: str


def incomplete_uploads(prefix: ObjectPath) -> list[IncompleteUpload]:
    """Multipart uploads started under the prefix and never completed nor aborted (S3 only; other
    stores expire theirs: Azure's uncommitted blocks after 7 days, GCS's by bucket policy)."""
    if SCHEMES[prefix.scheme] != "s3":
        return []
    out, marker = [], {}
    while True:
        raw = _s3_request(prefix, "GET", "", {"uploads": "", "prefix": prefix.prefix, **marker})
        root = ET.fromstring(raw)
        ns = {"s": root.tag.split("}")[0].strip("{")} if root.tag.startswith("{") else {}
        tag = (lambda t: f"s:{t}") if ns else (lambda t: t)
        for up in root.findall(tag("Upload"), ns):
            key = up.findtext(tag("Key"), "", ns)
            out.append(IncompleteUpload(ObjectPath(prefix.scheme, prefix.bucket, key),
                                        up.findtext(tag("UploadId"), "", ns),
                                        up.findtext(tag("Initiated"), "", ns)))
        if root.findtext(tag("IsTruncated"), "false", ns) != "true":
            return out
        marker = {"key-marker": root.findtext(tag("NextKeyMarker"), "", ns),
                  "upload-id-marker": root.findtext(tag("NextUploadIdMarker"), "", ns)}


def abort_upload(up: IncompleteUpload) -> None:
    _s3_request(up.path, "DELETE", up.path.key, {"uploadId": up.upload_id})

