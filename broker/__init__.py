"""What the client and the worker share: the wire protocol, its encodings and errors; and the
worker's broker thread (``broker``) and ZAP handler thread (``zap``). Each module's docstring
says what it owns and which thread runs it; most are pure functions any thread may call."""
