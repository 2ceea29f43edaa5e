"""The runtime layer under the offline Engine and the HTTP server: scheduler processes and the protocol they speak.

- ``messages``: the typed commands and replies, and their one encoder and decoder;
- ``transport``: ZMQ sockets over IPC;
- ``scheduler_process``: the body of a scheduler process, one rank of a world (take commands -> step -> send
  outputs);
- ``factory``: builds a rank's scheduler (model, pools, limits, tokenizer) from ``ServerArgs``;
- ``client``: ``SchedulerClient``, the one client core both front ends wrap;
- ``inputs``: prompt normalisation shared by the front ends.
"""
