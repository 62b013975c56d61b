"""Which errors are an outage of the store (spool the call, send it later) and which are bugs
(raise). Only an unreachable, timed-out or overloaded store is an outage: a `TypeError` in a log
call, a bad name or a deleted run must surface, not sit silently in the spool."""
from __future__ import annotations

import errno
import socket

import requests
import urllib3
from mlflow.exceptions import MlflowException

# Error codes of an unreachable or overloaded store (MLflow wraps a refused connection or a timeout
# of its REST client as INTERNAL_ERROR). Any other code (a bad name, a deleted run) is the caller's bug.
TRANSIENT_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "ENDPOINT_NOT_FOUND"}
_NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EHOSTUNREACH,
                   errno.ENETUNREACH, errno.ENETDOWN, errno.ETIMEDOUT, errno.EPIPE}
_NETWORK_ERRORS = (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                   requests.exceptions.ChunkedEncodingError, requests.exceptions.RetryError,
                   urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, socket.gaierror, socket.herror)


def is_transient(err: BaseException) -> bool:
    """True for connection and timeout errors, 5xx answers and MLflow's transient error codes."""
    if isinstance(err, MlflowException):
        return err.error_code in TRANSIENT_CODES or err.get_http_status_code() >= 500
    if isinstance(err, requests.exceptions.HTTPError):
        return err.response is not None and err.response.status_code >= 500
    if isinstance(err, _NETWORK_ERRORS):
        return True
    return isinstance(err, OSError) and err.errno in _NETWORK_ERRNOS  # socket.error is OSError
