"""Strangers at the job's store, for store_flood.sh: from another host, a
horde of HORDE idle connections that never say a word (each one the store
closes is opened again at once) and a flood of connections opened and closed
as fast as they complete, until STOP_FILE exists or SECONDS pass. Plain
sockets; knows no token. Prints how many connections it made.

    store_flood.py ADDRESS PORT HORDE SECONDS STOP_FILE
"""
import os
import select
import socket
import sys
import time

address, port, horde_size, seconds, stop_file = (
    sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
made = 0


def open_idle():
    global made
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect((address, port))
    except BlockingIOError:
        pass
    made += 1
    return s


horde = {}
poller = select.poll()


def add_idle():
    s = open_idle()
    horde[s.fileno()] = s
    poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)


for _ in range(horde_size):
    add_idle()
print(f"horde of {horde_size} up", flush=True)
end = time.time() + seconds
while time.time() < end and not os.path.exists(stop_file):
    # The flood: 50 connections that close as soon as they are made.
    for _ in range(50):
        try:
            socket.create_connection((address, port), timeout=1).close()
        except OSError:
            pass
        made += 1
    # The horde: read and ignore the greeting; replace what the store closed.
    for fd, _ in poller.poll(10):
        s = horde[fd]
        try:
            alive = s.recv(4096) != b""
        except BlockingIOError:
            alive = True
        except OSError:
            alive = False
        if not alive:
            poller.unregister(s)
            del horde[fd]
            s.close()
            add_idle()
print(f"made {made} connections", flush=True)
