"""Storage: where checkpoint files live, behind one interface (`backend.Backend`).

- `urls`: `location(path)` (a local path or an s3:// gs:// az:// URL; other schemes refused) and
  `backend(location)`, the scheme -> backend table;
- `local` (POSIX files), `object_store` + `store_backend` + `store_reads` + `s3_multipart`
  (S3, GCS, Azure through obstore): the two backends;
- `safetensors_codec` and `writer`: the safetensors header and dtype table, the streaming writer;
- `reader` and `planner`: tensor reads and the read planner (merged ranged GETs in a store);
- `commit`: the one commit sequence (stage, check, fsync, publish the writer's marker);
- `save_root`: a save root's `latest` pointer, `resolve`, interrupted saves;
- `files`, `checksums`, `dcp`: file calls on any location, crc32 helpers, DCP's reader.

Code outside this package calls these functions; it never tests a path's type nor imports the
object-store client (tests/test_hygiene.py).
"""

from megatron_ucp.storage import object_store as _object_store
from megatron_ucp.storage.backend import AlreadyExists, Backend, ByteRun, FileWriter, Staged, TensorFile
from megatron_ucp.storage.checksums import crc32, crc32_combine, crc32_many
from megatron_ucp.storage.commit import (
    commit_group_job,
    file_in_the_way,
    fsync_path,
    group_staged,
    publish,
    refuse_non_empty,
    staged,
    staged_dir,
)
from megatron_ucp.storage.files import (
    dcp_reader,
    download,
    has_local_files,
    list_files,
    local_file,
    names_in,
    put,
    read_bytes,
    size_of,
)
from megatron_ucp.storage.object_store import StoreError
from megatron_ucp.storage.planner import ReadsFiles, plan_reads
from megatron_ucp.storage.reader import Reader
from megatron_ucp.storage.safetensors_codec import (
    DTYPE_NAMES,
    DTYPE_TO_ST,
    NAME_TO_DTYPE,
    ST_TO_DTYPE,
    tensor_bytes,
)
from megatron_ucp.storage.save_root import (
    LATEST,
    NotACheckpoint,
    incomplete_uploads,
    interrupted_saves,
    is_checkpoint,
    resolve,
    write_latest,
)
from megatron_ucp.storage.save_root import clean as clean_save_root
from megatron_ucp.storage.urls import Location, backend, location
from megatron_ucp.storage.writer import SafetensorsWriter, write_tensors


def set_upload_part_bytes(nbytes: int) -> None:
    """The multipart part size of this process's uploads (tests: a writer killed with parts in the
    store needs parts smaller than its file; S3's 5 MiB minimum applies to completed uploads)."""
    _object_store.PART_BYTES = nbytes


__all__ = [
    "AlreadyExists", "Backend", "ByteRun", "DTYPE_NAMES", "DTYPE_TO_ST", "FileWriter", "LATEST",
    "Location", "NAME_TO_DTYPE", "NotACheckpoint", "Reader", "ReadsFiles", "ST_TO_DTYPE",
    "SafetensorsWriter", "Staged", "StoreError", "TensorFile", "backend", "clean_save_root",
    "commit_group_job", "crc32", "crc32_combine", "crc32_many", "dcp_reader", "download",
    "file_in_the_way", "fsync_path", "group_staged", "has_local_files", "incomplete_uploads",
    "interrupted_saves", "is_checkpoint", "list_files", "local_file", "location", "names_in",
    "plan_reads", "publish", "put", "read_bytes", "refuse_non_empty", "resolve",
    "set_upload_part_bytes", "size_of", "staged", "staged_dir", "tensor_bytes",
    "write_latest", "write_tensors",
]
