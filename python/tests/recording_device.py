"""A device whose streams and events log what is asked of them, the work itself running at once on the host
(ess.integrations._device.HostDevice's): the stream order an adapter asks of CUDA, which the host backend cannot
show. Its log's entries: ("launch", stream, fn name), ("wait_stream", stream, other), ("record", event, stream),
("wait_event", stream, event), ("sync_stream", stream), ("sync_event", event)."""
from ess.integrations import _device


class Log:
    def __init__(self):
        self.entries = []

    def add(self, *entry):
        self.entries.append(entry)


class RecStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.add("wait_stream", self, other)

    def synchronize(self):
        self.log.add("sync_stream", self)

    def __repr__(self):
        return self.name


class RecEvent:
    def __init__(self, device):
        self.device = device

    def record(self, stream=None):
        self.device.log.add("record", self, stream or self.device.current_stream())

    def wait(self, stream=None):
        self.device.log.add("wait_event", stream or self.device.current_stream(), self)

    def query(self):
        return True

    def synchronize(self):
        self.device.log.add("sync_event", self)


class RecordingDevice(_device.HostDevice):
    def __init__(self, device="cpu"):
        super().__init__(device)
        self.log = Log()
        self.streams = 0
        self._current = RecStream(self.log, "schedule")

    def Stream(self):
        self.streams += 1
        return RecStream(self.log, f"stream{self.streams}")

    def Event(self):
        return RecEvent(self)

    def stream(self, s):
        device = self

        class Ctx:
            def __enter__(self):
                self.previous, device._current = device._current, s

            def __exit__(self, *exc):
                device._current = self.previous
        return Ctx()

    def launch(self, fn):
        self.log.add("launch", self._current, fn.__name__)
        fn()
