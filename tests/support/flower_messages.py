"""Flower Messages as a test hands them to a ClientApp or a strategy, without a Grid."""

from uuid import uuid4

from flwr.app import Message


def pushed(msg: Message) -> Message:
    """``msg`` with the message id that ``Grid.push_messages`` gives it (a reply needs it to say what it answers)."""
    msg.metadata.__dict__["_message_id"] = uuid4().hex
    return msg
