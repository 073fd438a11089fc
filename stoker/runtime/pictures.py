"""A worker's pictures in the stage cache: each as the served model's processor prepares it (its tensors), as vLLM's
generate endpoint takes it (its rendering), or as a server that sees gets it (the served picture), with the cache
addresses they are kept under.

The decode stage writes them (`stoker.runtime.stages.decode`); the inference side reads them back, and when the
cache lost one it is made again from the input's bytes while the job store still holds them (and cached again).
`WorkerContext.pictures` builds the one `Pictures` of a process over its context, whose members it reads only when
a picture asks for them: a worker that never sees a picture loads no processor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from PIL import Image

from stoker.adapters.backends.vision import ImagePreparer, PreparedImage
from stoker.adapters.cache import StageCache
from stoker.adapters.render import ITEM, RenderedPicture, Renderer
from stoker.adapters.store import Store
from stoker.core import cachekeys
from stoker.core.cachekeys import PICTURE, VISION_TENSORS, CacheAddress
from stoker.core.errors import StokerError
from stoker.core.imaging import DecodeParams, decode_rgb, served_picture
from stoker.core.media import ContentHash
from stoker.settings import WorkerSettings

T = TypeVar("T")


class PictureSource(Protocol):
    """What `Pictures` reads from its worker's context (`WorkerContext`), each member built when first read."""

    @property
    def settings(self) -> WorkerSettings:
        """The worker's settings: the cache's size caps."""

    @property
    def cache(self) -> StageCache:
        """The stage cache the pictures are kept in."""

    @property
    def store(self) -> Store:
        """The job store, which holds the inputs' bytes."""

    @property
    def decode_params(self) -> DecodeParams:
        """How a picture is decoded (part of every address here)."""

    @property
    def image_preparer(self) -> ImagePreparer | None:
        """The served model's image processor; None for a model that reads only text."""

    @property
    def picture_bounds(self) -> tuple[int, int] | None:
        """The bounds of a served picture; None where no server gets pictures."""

    @property
    def renderer(self) -> Renderer:
        """The served model's renderer as vLLM's render tier renders."""

    def decode_address(self, digest: str, scope: str) -> CacheAddress:
        """Where decode's outputs for this content are cached."""


class Pictures:
    """A worker's pictures and their tensors in the stage cache: written by the decode stage, read (or made again)
    by the inference side."""

    def __init__(self, source: PictureSource) -> None:
        self.source = source

    # -- where they are kept ----------------------------------------------------------------------------------
    @property
    def rendering_decode(self) -> str:
        """The decode parameters a picture's rendering is made from, as its cache address names them."""
        return repr(self.source.decode_params)

    def rendering_address(self, digest: str, scope: str) -> CacheAddress:
        """Where a picture's rendering is cached, in `scope`."""
        return self.source.renderer.picture_address(digest, self.rendering_decode, scope)

    def vision_address(self, digest: str, scope: str) -> CacheAddress:
        """Cache address of a picture's tensors from the configured model's image processor (a model that sees)."""
        preparer = self.source.image_preparer
        identity = preparer.identity if preparer else ""
        return cachekeys.vision_address(digest, scope, self.source.decode_params, identity)

    # -- renderings for vLLM's generate endpoint --------------------------------------------------------------
    def rendered_picture(self, digest: str, scope: str) -> RenderedPicture | None:
        """A picture's rendering for the generate endpoint, as the decode stage cached it (in the scope it was
        decoded in), or made again from the input's bytes while the job store still holds them (and cached); None
        when neither has it."""
        address = self.rendering_address(digest, scope)
        return self._cached_or_again(
            digest, address, ITEM, RenderedPicture.from_bytes, lambda picture: self.put_rendered(digest, scope, picture)
        )

    def put_rendered(self, digest: str, scope: str, picture: Image.Image) -> RenderedPicture | None:
        """Render a decoded picture for the generate endpoint and cache it (under the tensors' size cap); None for
        a model that reads no pictures, or one its processor cannot read."""
        if not self.source.renderer.sees:
            return None
        try:
            return self.render_picture(digest, scope, picture)
        except StokerError:
            return None

    def render_picture(self, digest: str, scope: str, picture: Image.Image) -> RenderedPicture:
        """Render a decoded picture as vLLM's item and cache it in `scope` (under the tensors' size cap); the
        processor's refusal is raised (`image_corrupt`)."""
        rendered = self.source.renderer.picture(picture)
        limit = self.source.settings.cache_max_tensor_bytes
        self.source.cache.put_bytes(self.rendering_address(digest, scope), rendered.to_bytes(), part=ITEM, limit=limit)
        return rendered

    # -- the served model's tensors ---------------------------------------------------------------------------
    def prepared_image(self, digest: str, scope: str) -> PreparedImage | None:
        """One picture's tensors as the served model's image processor made them in the decode stage (from the
        cache scope it was decoded in), or prepared again from the input's bytes while the job store still holds
        them (and cached); None for a text-only model, or when neither has it."""
        preparer = self.source.image_preparer
        if preparer is None:
            return None
        address = self.vision_address(digest, scope)

        def prepare(picture: Image.Image) -> PreparedImage | None:
            try:
                prepared = preparer.prepare(picture)
            except StokerError:
                return None
            self.put_prepared(address, prepared)
            return prepared

        return self._cached_or_again(digest, address, VISION_TENSORS, PreparedImage.from_bytes, prepare)

    def put_prepared(self, address: CacheAddress, prepared: PreparedImage) -> None:
        """Cache a picture's tensors at its vision address (under the tensors' own size cap)."""
        limit = self.source.settings.cache_max_tensor_bytes
        self.source.cache.put_bytes(address, prepared.to_bytes(), part=VISION_TENSORS, limit=limit)

    # -- the picture a server that sees gets ------------------------------------------------------------------
    def picture(self, digest: str, scope: str) -> bytes | None:
        """A decoded picture as a server that sees images gets it (`served`), from the cache scope it was decoded
        in, or made again from the input's bytes while the job store still holds them (the cache lost it); None when
        neither has it."""
        address = self.source.decode_address(digest, scope)
        if self.source.picture_bounds is None:
            return self.source.cache.get_bytes(address, part=PICTURE)

        def serve(picture: Image.Image) -> bytes:
            served = self.served(picture)
            self.source.cache.put_bytes(address, served, part=PICTURE)
            return served

        return self._cached_or_again(digest, address, PICTURE, bytes, serve)

    def served(self, picture: Image.Image) -> bytes:
        """A decoded picture as the server gets it: at the served model's size, in a form the stage cache keeps
        (`served_picture`: PNG, or the best JPEG within the cache's value limit), so that the inference worker only
        ever reads it."""
        bounds = self.source.picture_bounds
        assert bounds is not None  # the `openai` backend's
        return served_picture(picture, *bounds, max_bytes=self.source.settings.cache_max_value_bytes)

    # -- the one shape of cached-or-made-again ----------------------------------------------------------------
    def _cached_or_again(
        self,
        digest: str,
        address: CacheAddress,
        part: str,
        read: Callable[[bytes], T],
        make: Callable[[Image.Image], T | None],
    ) -> T | None:
        """What the cache keeps at `address` (`part`), read by `read`; when it has nothing this version can read,
        `make` from the picture decoded again (None when the input's bytes are gone or undecodable)."""
        found = self.source.cache.get_bytes(address, part=part)
        if found is not None:
            try:
                return read(found)
            except ValueError:
                pass  # not what this version writes: made again below
        picture = self.picture_again(digest)
        return None if picture is None else make(picture)

    def picture_again(self, digest: str) -> Image.Image | None:
        """The decoded picture from the input's bytes in the job store; None when they are gone or undecodable."""
        data = self.source.store.blobs.get_blob(ContentHash(digest))
        if data is None:
            return None
        try:
            return decode_rgb(data, self.source.decode_params)
        except StokerError:
            return None
