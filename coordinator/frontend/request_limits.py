"""Limits on what one public request may ask for, checked before any work proportional to its size.

The request's size itself is capped by the transports (ServerConfig.max_request_bytes: the gRPC
server's receive limit, the HTTP body limit in coordinator.frontend.http_api), and the bytes of all requests
read at once by the RequestGate (max_request_bytes_in_flight); the prompt is bounded by the
context (specdec.bounded_tokenize); what remains is checked here: the number and length of stop
strings, which the scheduler's thread would otherwise scan after every committed token
(coordinator.rounds.text_stream). Each message names the limit and the flag that raises it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.config import ServerConfig


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int
    max_stop_strings: int
    max_stop_string_length: int

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(config.max_request_bytes, config.max_stop_strings, config.max_stop_string_length)

    def check_stops(self, stops: Sequence | str | None) -> None:
        """ValueError naming the limit; costs O(max_stop_strings) whatever the client sent."""
        if stops is None or isinstance(stops, str):
            stops = () if stops is None else (stops,)
        if len(stops) > self.max_stop_strings:
            raise ValueError(f"stop: at most {self.max_stop_strings} stop strings are allowed, got {len(stops)} "
                             f"(the server's --max-stop-strings)")
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > self.max_stop_string_length:
                raise ValueError(f"stop[{i}]: a stop string may have at most {self.max_stop_string_length} "
                                 f"characters, got {len(stop)} (the server's --max-stop-string-length)")

    def too_large(self, size: int) -> str:
        """The message for a request body of `size` bytes over max_request_bytes."""
        return (f"the request is {size} bytes, more than the {self.max_request_bytes} bytes this server "
                f"accepts (the server's --max-request-bytes)")
