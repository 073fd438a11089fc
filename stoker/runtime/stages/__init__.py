"""The stages of a job's preprocessing, one module each: what a stage does from reading its record to writing it.

decode       an image's parts into the stage cache (or a render job's rendering)
ocr          an image's text, whole or cut into bands on any free child
audio        a recording's probe and transcript
keyframes    a video's keyframes, entered into the image branch
fetch        a URL input's download
tokenization every branch joined: the prompt built, tokenized and handed to inference

A Celery task (`tasks/`) calls a stage's one entry point with the worker's context and its message's arguments;
the stage runs under the shared skeleton (`stoker.runtime.stage`) and never calls back into a task.
"""
