"""Free loopback ports for the local tools: a race by nature (another process may take one
before it is bound), acceptable on a developer's machine and in tests."""

import socket


def free_port() -> int:
    """A loopback port that was free just now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_range(count: int) -> int:
    """The first of `count` consecutive loopback ports that are free now."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        sockets = [socket.socket() for _ in range(count)]
        try:
            for i, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports")
