"""TCP: the links that carry the protocol over byte transports (:mod:`.links`: an asyncio
``BufferedProtocol``, and any anyio ``ByteStream``), and accepting connections under
admission (:mod:`.accept`)."""
