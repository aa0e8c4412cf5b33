"""What rank 0 and its workers say to each other over their sockets, and how it is framed.

A message is JSON plus raw array buffers, never pickle: a pipeline's ports may be reached by other hosts, and
unpickling what arrives there would run whatever code a sender chose. Arrays (numeric dtypes only), tuples and
slices are written as tagged JSON objects; each frame is its length, then the JSON, then each buffer with its length.
"""
from __future__ import annotations

import dataclasses
import json
import socket
import struct

import numpy as np
import torch

MAX_MESSAGE_BYTES = 1 << 32
ARRAY_KINDS = "biuf"   # bool, signed and unsigned integers, floats


class BadMessage(ValueError):
    """A frame that is not one of ours."""


def encode(obj) -> bytes:
    buffers: list[bytes] = []

    def tag(x):
        if isinstance(x, np.ndarray):
            x = np.ascontiguousarray(x)
            buffers.append(x.tobytes())
            return {"__array__": [x.dtype.str, list(x.shape)]}
        if isinstance(x, slice):
            return {"__slice__": [x.start, x.stop, x.step]}
        if isinstance(x, tuple):
            return {"__tuple__": [tag(i) for i in x]}
        if isinstance(x, list):
            return [tag(i) for i in x]
        if isinstance(x, dict):
            return {str(k): tag(v) for k, v in x.items()}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"cannot send a {type(x).__name__}")
    head = json.dumps(tag(obj)).encode()
    parts = [struct.pack("<Q", len(head)), head]
    for b in buffers:
        parts += [struct.pack("<Q", len(b)), b]
    return b"".join(parts)


def decode(frame: bytes):
    if len(frame) < 8:
        raise BadMessage(f"a frame of {len(frame)} bytes")
    (n,) = struct.unpack_from("<Q", frame)
    try:
        head = json.loads(frame[8:8 + n])
    except ValueError as e:
        raise BadMessage(f"not a message: {e}") from None
    at = 8 + n

    def untag(x):
        nonlocal at
        if isinstance(x, list):
            return [untag(i) for i in x]
        if not isinstance(x, dict):
            return x
        if "__array__" in x:
            dtype, shape = np.dtype(x["__array__"][0]), tuple(int(d) for d in x["__array__"][1])
            if dtype.kind not in ARRAY_KINDS or at + 8 > len(frame):
                raise BadMessage(f"an array of {dtype} is not one of ours")
            (size,) = struct.unpack_from("<Q", frame, at)
            if size != dtype.itemsize * int(np.prod(shape)) or at + 8 + size > len(frame):
                raise BadMessage(f"an array of shape {shape} with {size} bytes")
            arr = np.frombuffer(frame, dtype=dtype, count=int(np.prod(shape)), offset=at + 8).reshape(shape)
            at += 8 + size
            return arr.copy()
        if "__slice__" in x:
            return slice(*x["__slice__"])
        if "__tuple__" in x:
            return tuple(untag(i) for i in x["__tuple__"])
        return {k: untag(v) for k, v in x.items()}
    return untag(head)


def send_msg(sock: socket.socket, obj) -> None:
    data = encode(obj)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def recv_msg(sock: socket.socket):
    """The next message, or None when the other side has closed the socket. BadMessage for a frame that is not
    one of ours."""
    head = _recv_exactly(sock, 8)
    if head is None:
        return None
    (n,) = struct.unpack("<Q", head)
    if n > MAX_MESSAGE_BYTES:
        raise BadMessage(f"a frame of {n} bytes")
    body = _recv_exactly(sock, n)
    return None if body is None else decode(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            return None
        buf += part
    return bytes(buf)


def pack_step(input_ids: torch.Tensor, meta, logits_indices: torch.Tensor, lora=None) -> dict:
    """A forward's inputs as plain data (meta: models.llama.AttentionMetadata; lora: models.lora.LoraStep, its
    adapters named by (name, folder, rank 0's object id): a worker reads each once, and again if it is replaced)."""
    def plain(v):
        return v.numpy() if isinstance(v, torch.Tensor) else v
    return {"input_ids": plain(input_ids), "logits_indices": plain(logits_indices),
            "meta": {f.name: plain(getattr(meta, f.name)) for f in dataclasses.fields(meta)},
            "lora": None if lora is None else [((a.name, a.path, id(a)), plain(rows)) for a, rows in lora.groups]}


def unpack_step(msg: dict, meta_type):
    """(input_ids, meta, logits_indices, [(adapter key, its rows)] or None)."""
    def tensor(v):
        return torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    lora = msg["lora"] and [(tuple(key), tensor(rows)) for key, rows in msg["lora"]]
    return (tensor(msg["input_ids"]), meta_type(**{k: tensor(v) for k, v in msg["meta"].items()}),
            tensor(msg["logits_indices"]), lora)
