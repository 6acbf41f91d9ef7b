// WanMesh Stream Sampler in the browser: a prompt typed while the stream runs switches it at the next chunk.
// Role: ComfyUI frontend extension, loaded by the page from the pack's WEB_DIRECTORY (runs in the browser, both the
// 2024 built-in frontend and today's). It adds three widgets to the node that are not inputs (left out of the API
// prompt): "live_prompt" (the new text), a "send live prompt" button, and "live_status" (the chunk where it applied,
// or the server's one-line refusal). The button posts to the pack's route POST /wanmesh/stream/<prompt id>/prompt
// for the prompt ComfyUI is running, or else the one last queued from this page (a prompt posted while queued
// applies at chunk 1). The stream needs its text_encoder input connected.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const STREAM_NODE = "WanMeshStreamSampler";
let runningPrompt = null; // the prompt id of ComfyUI's execution_start, until its end (executing with no node)
let lastQueued = null; // the prompt id /prompt answered for this page's last queue

api.addEventListener("execution_start", (event) => { runningPrompt = event.detail?.prompt_id ?? null; });
api.addEventListener("executing", (event) => {
    const node = event.detail && typeof event.detail === "object" ? event.detail.node : event.detail;
    if (node === null || node === undefined) runningPrompt = null;
});
const queuePrompt = api.queuePrompt.bind(api);
api.queuePrompt = async (...args) => {
    const answer = await queuePrompt(...args);
    lastQueued = answer?.prompt_id ?? lastQueued;
    return answer;
};

function notAnInput(widget) {
    widget.serialize = false; // not in the saved workflow's widget values
    widget.options = { ...(widget.options ?? {}), serialize: false }; // not in the API prompt
    return widget;
}

async function sendLivePrompt(node, textWidget, statusWidget) {
    const text = String(textWidget.value ?? "").trim();
    const promptId = runningPrompt ?? lastQueued;
    if (!text || !promptId) {
        statusWidget.value = !text ? "type a prompt first" : "queue the stream first";
        node.setDirtyCanvas(true, true);
        return;
    }
    statusWidget.value = "waiting for the next chunk...";
    node.setDirtyCanvas(true, true);
    try {
        const response = await api.fetchApi(`/wanmesh/stream/${encodeURIComponent(promptId)}/prompt`, {
            method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ prompt: text }),
        });
        const answer = await response.json();
        statusWidget.value = response.ok ? `switched at chunk ${answer.chunk}` : `not applied: ${answer.error}`;
    } catch (error) {
        statusWidget.value = `not applied: ${error}`;
    }
    node.setDirtyCanvas(true, true);
}

app.registerExtension({
    name: "WanMesh.LivePrompt",
    async nodeCreated(node) {
        if (node.comfyClass !== STREAM_NODE) return;
        const textWidget = notAnInput(node.addWidget("text", "live_prompt", "", () => {}, {}));
        const statusWidget = notAnInput(node.addWidget("text", "live_status", "", () => {}, {}));
        notAnInput(node.addWidget("button", "send live prompt", null,
                                  () => sendLivePrompt(node, textWidget, statusWidget), {}));
    },
});
