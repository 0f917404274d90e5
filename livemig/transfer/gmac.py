"""AES-256-GMAC (the tag of AES-GCM over no plaintext, the message as associated data)
that releases the GIL while it hashes.

`cryptography`'s AES-GCM holds the GIL for the whole call: a receiving thread that
finishes a chunk's `recv_into` then waits for a verifier thread's hash to end, and
several verifier threads hash one after the other. Calling OpenSSL's EVP interface
through ctypes releases the GIL for each call, so hashing runs beside receiving and
scales with threads. The tags are the same (standard AES-GCM; tested against
`cryptography`). Where libcrypto cannot be loaded, `cryptography` computes them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

log = logging.getLogger("livemig.transfer")

NONCE = bytes(12)  # each key tags one message (protocol.chunk_key): a fixed nonce is safe
TAG = 16
_GCM_GET_TAG = 0x10  # EVP_CTRL_GCM_GET_TAG
_MAX_UPDATE = 1 << 30  # EVP_EncryptUpdate takes an int length


def _load() -> Any:
    names = ["libcrypto.so.3", "libcrypto.so.1.1", ctypes.util.find_library("crypto")]
    for name in filter(None, names):
        try:
            lib = ctypes.CDLL(name)  # CDLL (not PyDLL): every call releases the GIL
            p, i, vp = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
            lib.EVP_CIPHER_CTX_new.restype = p
            lib.EVP_CIPHER_CTX_new.argtypes = []
            lib.EVP_CIPHER_CTX_free.argtypes = [p]
            lib.EVP_aes_256_gcm.restype = p
            lib.EVP_aes_256_gcm.argtypes = []
            lib.EVP_EncryptInit_ex.argtypes = [p, p, p, ctypes.c_char_p, ctypes.c_char_p]
            lib.EVP_EncryptUpdate.argtypes = [p, vp, ctypes.POINTER(i), vp, i]
            lib.EVP_EncryptFinal_ex.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(i)]
            lib.EVP_CIPHER_CTX_ctrl.argtypes = [p, i, i, ctypes.c_char_p]
            for fn in (lib.EVP_EncryptInit_ex, lib.EVP_EncryptUpdate, lib.EVP_EncryptFinal_ex,
                       lib.EVP_CIPHER_CTX_ctrl):  # fmt: skip
                fn.restype = i
            return lib
        except (OSError, AttributeError):
            continue
    log.info("libcrypto not loadable: chunk MACs hold the GIL (cryptography)")
    return None


_lib = _load()
_update: Any = _lib.EVP_EncryptUpdate if _lib is not None else None  # a ctypes function, or None


def address(buf: Any) -> int:
    """Where a buffer's bytes start in memory (read-only buffers too)."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def releases_gil() -> bool:
    return _lib is not None


class Gmac:
    """Incremental GMAC under a 32-byte key: `update` any number of times, then `digest`."""

    def __init__(self, key: bytes) -> None:
        self._ctx: Any = None
        self._enc: Any = None
        if len(key) != 32:
            raise ValueError("GMAC key must be 32 bytes")
        if _lib is None:
            self._enc = Cipher(algorithms.AES(key), modes.GCM(NONCE)).encryptor()
            return
        self._ctx = _lib.EVP_CIPHER_CTX_new()
        if not self._ctx or _lib.EVP_EncryptInit_ex(self._ctx, _lib.EVP_aes_256_gcm(), None, key, NONCE) != 1:
            self._free()
            raise RuntimeError("OpenSSL refused AES-256-GCM")
        self._n = ctypes.c_int(0)
        self._np = ctypes.byref(self._n)

    def update(self, buf: Any) -> None:
        if self._enc is not None:
            self._enc.authenticate_additional_data(buf)
            return
        if self._ctx is None:
            raise RuntimeError("GMAC already finalized")
        self.update_at(address(buf), memoryview(buf).nbytes)  # `buf` stays alive for the call

    @property
    def native(self) -> bool:
        """Whether `update_at` works (libcrypto), else only `update` (the fallback)."""
        return self._ctx is not None

    def update_at(self, addr: int, n: int) -> None:
        """`update` with the `n` bytes at `addr`, which the caller keeps alive for the
        call: a receiving thread hashes a chunk in many pieces, and looking up a buffer's
        address costs several microseconds a time."""
        if self._ctx is None:
            raise RuntimeError("GMAC already finalized")
        for off in range(0, n, _MAX_UPDATE):
            k = min(_MAX_UPDATE, n - off)
            if _update(self._ctx, None, self._np, addr + off, k) != 1:
                raise RuntimeError("OpenSSL GMAC update failed")

    def digest(self) -> bytes:
        if self._enc is not None:
            self._enc.finalize()
            return self._enc.tag
        if self._ctx is None:
            raise RuntimeError("GMAC already finalized")
        tag = ctypes.create_string_buffer(TAG)
        try:
            ok = _lib.EVP_EncryptFinal_ex(self._ctx, tag, ctypes.byref(self._n)) == 1  # no plaintext: no output
            ok = ok and _lib.EVP_CIPHER_CTX_ctrl(self._ctx, _GCM_GET_TAG, TAG, tag) == 1
        finally:
            self._free()
        if not ok:
            raise RuntimeError("OpenSSL GMAC finalize failed")
        return tag.raw

    def _free(self) -> None:
        if self._ctx:
            _lib.EVP_CIPHER_CTX_free(self._ctx)
        self._ctx = None

    def __del__(self) -> None:
        self._free()


def gmac(key: bytes, buf: Any) -> bytes:
    h = Gmac(key)
    h.update(buf)
    return h.digest()
