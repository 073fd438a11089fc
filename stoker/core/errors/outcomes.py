"""Errors of a job's or a resource's state and of the model (not found, ended, cancelled, unauthorized, the model's
failures), neither an input's fault nor worth a retry."""

from __future__ import annotations

from stoker.core.errors.base import StokerError


class ResultTooLarge(StokerError):
    """The model's answer is larger than a job's stored result may be."""

    code = "result_too_large"


class JobNotFound(StokerError):
    """No job with that id."""

    code = "job_not_found"
    http_status = 404


class ResponseNotFound(StokerError):
    """No stored response with that id (the Responses API: never stored, expired, deleted, or another tenant's)."""

    code = "response_not_found"
    http_status = 404


class FileNotFound(StokerError):
    """No such file."""

    code = "file_not_found"
    http_status = 404


class BatchNotFound(StokerError):
    """No such batch."""

    code = "batch_not_found"
    http_status = 404


class BatchAlreadyEnded(StokerError):
    """The batch has ended: it cannot be cancelled."""

    code = "batch_already_ended"
    http_status = 409


class BatchCancelled(StokerError):
    """The batch was cancelled before this request ran."""

    code = "batch_cancelled"
    http_status = 409


class BatchExpired(StokerError):
    """This request could not be executed before the batch's completion window expired."""

    code = "batch_expired"
    http_status = 504


class JobAlreadyEnded(StokerError):
    """The job has already ended: there is nothing left to cancel."""

    code = "job_already_ended"
    http_status = 409


class Cancelled(StokerError):
    """The job was cancelled: its work stops and nothing of it is kept."""

    code = "cancelled"
    http_status = 409


class Unauthorized(StokerError):
    """A valid API key is required: send `Authorization: Bearer <key>`."""

    code = "unauthorized"
    http_status = 401


class ModelNotFound(StokerError):
    """No such model is served here."""

    code = "model_not_found"
    http_status = 404


class EndpointNotServed(StokerError):
    """This endpoint is not served here: the served models cannot answer it."""

    code = "endpoint_not_served"
    http_status = 404


class ClientGone(StokerError):
    """The client closed the connection before the answer was ready; the job was given up."""

    code = "client_disconnected"
    http_status = 499


class InferenceFailed(StokerError):
    """The model failed on this request."""

    code = "inference_failed"


class ImageFeaturesMismatch(InferenceFailed):
    """The prompt's image tokens and the pictures' features do not match: the model cannot place them."""

    code = "image_features_mismatch"
