"""Generated gRPC/protobuf modules of the control plane's v1 protocol.

Built from ``protos/paramserver/control/v1/*.proto`` at install time (see
setup.py); never edited or committed.
"""
