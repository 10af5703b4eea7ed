// Interop peer: TS SDK v1 (@modelcontextprotocol/sdk 1.32.2) over Streamable HTTP on loopback.
//
// Environment switches:
//   JSON_RESPONSE=1  answer POSTs with application/json instead of an SSE stream
//   STATEFUL=1       assign an Mcp-Session-Id at initialize, keep one transport per session and
//                    answer unknown session ids with 404 (the spec's "session expired" signal)
// Listens on 127.0.0.1 with an OS-chosen port and prints "LISTENING <port>" once ready.
import { randomUUID } from 'node:crypto';
import express from 'express';
import * as z from 'zod';
import { McpServer } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { isInitializeRequest } from '@modelcontextprotocol/sdk/types.js';

const jsonResponse = process.env.JSON_RESPONSE === '1';
const stateful = process.env.STATEFUL === '1';

function buildServer() {
  const server = new McpServer({ name: 'iteron-interop-ts-v1', version: '1.32.2' });
  server.registerTool(
    'echo',
    { description: 'Return the given text unchanged', inputSchema: { text: z.string() } },
    async ({ text }) => ({ content: [{ type: 'text', text }] }),
  );
  return server;
}

function rpcError(res, status, code, message) {
  res.status(status).json({ jsonrpc: '2.0', error: { code, message }, id: null });
}

const app = express();
app.use(express.json({ limit: '1mb' }));

if (stateful) {
  const sessions = new Map();
  app.all('/mcp', async (req, res) => {
    const sid = req.header('mcp-session-id');
    if (sid !== undefined) {
      const transport = sessions.get(sid);
      if (transport === undefined) {
        rpcError(res, 404, -32001, 'Session not found');
        return;
      }
      await transport.handleRequest(req, res, req.body);
      return;
    }
    if (req.method !== 'POST' || !isInitializeRequest(req.body)) {
      rpcError(res, 400, -32000, 'Bad Request: no session id and not an initialize request');
      return;
    }
    const transport = new StreamableHTTPServerTransport({
      sessionIdGenerator: () => randomUUID(),
      enableJsonResponse: jsonResponse,
      onsessioninitialized: (id) => {
        sessions.set(id, transport);
      },
    });
    transport.onclose = () => {
      if (transport.sessionId !== undefined) sessions.delete(transport.sessionId);
    };
    await buildServer().connect(transport);
    await transport.handleRequest(req, res, req.body);
  });
} else {
  app.post('/mcp', async (req, res) => {
    // Stateless: a fresh server and transport for every request.
    const server = buildServer();
    const transport = new StreamableHTTPServerTransport({
      sessionIdGenerator: undefined,
      enableJsonResponse: jsonResponse,
    });
    res.on('close', () => {
      transport.close();
      server.close();
    });
    await server.connect(transport);
    await transport.handleRequest(req, res, req.body);
  });
  app.all('/mcp', (_req, res) => {
    rpcError(res, 405, -32000, 'Method not allowed.');
  });
}

const listener = app.listen(0, '127.0.0.1', () => {
  process.stdout.write(`LISTENING ${listener.address().port}\n`);
});
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
