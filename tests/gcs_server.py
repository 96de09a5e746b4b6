"""A Cloud Storage server on localhost for the tests: ``python tests/gcs_server.py PORT BUCKET``.

The server is the ``gcp-storage-emulator`` package's (the JSON API over HTTP, objects in
memory). It leaves out two parts of the protocol that the clients of a run rely on, and this
script adds them to its handlers, as GCS documents them:

* a download's ``x-goog-generation`` and ``x-goog-metageneration`` headers, which TensorStore
  reads to know which version of an object it holds (Orbax's OCDBT manifests);
* the generation preconditions ``ifGenerationMatch`` (``0``: only if absent) and
  ``ifGenerationNotMatch``, answered with 412 and 304: TensorStore's conditional writes and
  cached reads, and the create-only write of ``attnjax.storage.create_exclusive``.

Prints ``ready`` once it listens; stops on SIGTERM.
"""

import signal
import sys
import threading
from http import HTTPStatus

from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_insert, _download, _get, _delete = objects.insert, objects.download, objects.get, objects.delete


def _current_generation(request, storage) -> str:
    """The object's generation, ``"0"`` where there is none."""
    bucket = request.params["bucket_name"]
    name = request.params.get("object_id") or (request.query.get("name") or [None])[0]
    if name is None and isinstance(request.data, dict):
        name = (request.data.get("meta") or request.data).get("name")
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except (NotFound, KeyError, TypeError):
        return "0"


def _precondition_failed(request, response, storage) -> bool:
    """Answers the request here (412 or 304) where a precondition does not hold."""
    match = request.query.get("ifGenerationMatch")
    not_match = request.query.get("ifGenerationNotMatch")
    if not match and not not_match:
        return False
    current = _current_generation(request, storage)
    if match and match[0] != current:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "Precondition Failed"}})
        return True
    if not_match and not_match[0] == current:
        response.status = HTTPStatus.NOT_MODIFIED
        return True
    return False


def _with_generation_headers(handler):
    def handle(request, response, storage, *args, **kwargs):
        if _precondition_failed(request, response, storage):
            return None
        result = handler(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return result
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        return result

    return handle


def _checked(handler):
    def handle(request, response, storage, *args, **kwargs):
        if _precondition_failed(request, response, storage):
            return None
        return handler(request, response, storage, *args, **kwargs)

    return handle


objects.insert = _checked(_insert)
objects.delete = _checked(_delete)
objects.download = _with_generation_headers(_download)
objects.get = _with_generation_headers(_get)

from gcp_storage_emulator.server import create_server  # noqa: E402  (routes read the handlers)


def main(port: int, bucket: str) -> None:
    server = create_server("localhost", port, in_memory=True, default_bucket=bucket)
    server.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print("ready", flush=True)
    stopped.wait()
    server.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
