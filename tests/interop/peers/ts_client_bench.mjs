// Times the official TypeScript SDK client (1.32.2) calling a stdio server's `echo` tool.
// Usage: node ts_client_bench.mjs <server command> [args...]   (env CALLS, default 2000)
// Prints "MEDIAN_US <microseconds>" for the calls after 200 warm-up calls.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const [command, ...args] = process.argv.slice(2);
const calls = Number(process.env.CALLS ?? "2000");
const transport = new StdioClientTransport({ command, args, env: { PATH: "/usr/bin:/bin" } });
const client = new Client({ name: "ts-bench", version: "1.0.0" });
await client.connect(transport);
await client.listTools();
for (let i = 0; i < 200; i++) {
  await client.callTool({ name: "echo", arguments: { text: "hello" } });
}
const times = [];
for (let i = 0; i < calls; i++) {
  const start = process.hrtime.bigint();
  const r = await client.callTool({ name: "echo", arguments: { text: "hello" } });
  times.push(Number(process.hrtime.bigint() - start) / 1000);
  if (r.content[0].text !== "hello") throw new Error("unexpected result");
}
times.sort((a, b) => a - b);
console.log(`MEDIAN_US ${times[Math.floor(times.length / 2)].toFixed(1)}`);
await client.close();
