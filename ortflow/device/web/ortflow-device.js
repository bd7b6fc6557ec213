// ortflow-device.js: train an ortflow device export (ortflow-export-artifacts RUN --web) in a browser or any page,
// on the user's own data, with onnxruntime-web 1.19.2's training build. An ES module, no build step, no dependency
// beside onnxruntime-web (the global `ort` its ort.training.wasm.min.js defines, or the one you pass).
//
//   import { openSet } from "./ortflow-device.js";
//   const set = await openSet("../");                          // the folder holding manifest.json
//   const data = set.textData(new Uint8Array(await file.arrayBuffer()));  // or: await set.imageData(files)
//   const batches = set.trainingBatches(data.train, { seed: 0 });
//   for (let step = 0; step < 200; step++) console.log(await set.trainStep(batches.next().value));
//   console.log(await set.evaluate(data.eval));                // { loss, accuracy, count }
//   console.log(await set.continueText("def main(", { tokens: 80 }));   // a language model's continuation
//   const params = await set.parameters();                     // bytes for ortflow-import-artifacts
//
// What the batches are, from the manifest's "preprocessing": text as token ids (UTF-8 bytes, or ortflow's own
// byte-level BPE from the set's tokenizer.json), windows of block_size tokens and each position's next token; images decoded, the shorter side resized to
// eval_resize, centre-cropped to image_size, scaled to 0..1 and normalised per channel, one folder per label. The
// batch shape is the set's (static): training batches are always full (samples drawn round a shuffled cycle of the
// data, as many steps as asked); the last evaluation batch is padded with targets the loss ignores (ignore_index).

export class DataError extends Error {}  // the user's data cannot train this set: the message says why, for a person

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array };

function mulberry32(seed) {  // a small seeded generator: the same seed, the same batches and samples
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function shuffled(count, random) {
  const order = Array.from({ length: count }, (_, i) => i);
  for (let i = count - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [order[i], order[j]] = [order[j], order[i]];
  }
  return order;
}

async function fetchBytes(url, what) {
  let response;
  try {
    response = await fetch(url);
  } catch (error) {
    throw new DataError(`${what} (${url}) could not be loaded: ${error.message || error}.`);
  }
  if (!response.ok) {
    throw new DataError(`${what} (${url}) could not be loaded (HTTP ${response.status}): serve the whole folder ` +
      "ortflow-export-artifacts wrote, or export the set again.");
  }
  return new Uint8Array(await response.arrayBuffer());
}

/** Open a set: its manifest, checkpoint and training, eval and optimizer models from `url` (a folder). */
export async function openSet(url, { ort = globalThis.ort } = {}) {
  if (!ort || !ort.TrainingSession) {
    throw new DataError("onnxruntime-web's training build is not loaded (ort.training.wasm.min.js, version 1.19.2).");
  }
  const base = new URL(String(url).replace(/\/?$/, "/"), globalThis.location ? location.href : undefined);
  const manifestBytes = await fetchBytes(new URL("manifest.json", base), "the set's manifest.json");
  let manifest;
  try {
    manifest = JSON.parse(new TextDecoder().decode(manifestBytes));
  } catch (error) {
    throw new DataError(`the set's manifest.json is not JSON (${error.message}): export the set again.`);
  }
  const files = manifest.files;
  const load = (key) => fetchBytes(new URL(files[key], base), `the set's ${key.replace("_", " ")} ${files[key]}`);
  const [checkpointState, trainModel, evalModel, optimizerModel] = await Promise.all(
    ["checkpoint", "training_model", "eval_model", "optimizer_model"].map(load));
  const session = await ort.TrainingSession.create({ checkpointState, trainModel, evalModel, optimizerModel });
  const set = new DeviceSet(ort, manifest, session, base);
  const tokenizer = (manifest.preprocessing || {}).tokenizer || {};
  if (tokenizer.kind === "bpe" && tokenizer.file) {
    const text = new TextDecoder().decode(await fetchBytes(new URL(tokenizer.file, base), `the set's ${tokenizer.file}`));
    set.bpe = new ByteLevelBPE(JSON.parse(text));
  }
  return set;
}

// GPT-2's byte-to-character map (tokenizers' ByteLevel): printable bytes map to themselves, the others to 256 + n.
const BYTE_CHARS = (() => {
  const printable = [];
  for (const [lo, hi] of [[33, 126], [161, 172], [174, 255]]) for (let b = lo; b <= hi; b++) printable.push(b);
  const chars = new Array(256);
  let extra = 0;
  for (let b = 0; b < 256; b++) chars[b] = String.fromCharCode(printable.includes(b) ? b : 256 + extra++);
  return chars;
})();
const CHAR_BYTES = new Map(BYTE_CHARS.map((c, b) => [c, b]));

/** ortflow's own byte-level BPE (data.tokenizer=bpe) from its tokenizer.json: words split by the tokenizer's regex,
 * each word's UTF-8 bytes mapped to byte-level characters, then merged by the merges' ranks; what `tokenizers`
 * computes for such a file. */
export class ByteLevelBPE {
  constructor(spec) {
    const split = ((spec.pre_tokenizer || {}).pretokenizers || []).find((p) => p.type === "Split");
    if (!split || !spec.model || spec.model.type !== "BPE") {
      throw new DataError("the set's tokenizer.json is not ortflow's own byte-level BPE: the module cannot encode it.");
    }
    this.pattern = new RegExp(split.pattern.Regex, "g");
    this.vocab = new Map(Object.entries(spec.model.vocab));
    this.tokens = new Map([...this.vocab].map(([token, id]) => [id, token]));
    this.ranks = new Map(spec.model.merges.map((m, i) => [Array.isArray(m) ? m.join(" ") : m, i]));
    this.cache = new Map();
  }

  encode(text) {
    const ids = [];
    const encoder = new TextEncoder();
    for (const word of text.match(this.pattern) || []) {
      let found = this.cache.get(word);
      if (!found) {
        found = this._merge(Array.from(encoder.encode(word), (b) => BYTE_CHARS[b])).map((t) => this.vocab.get(t));
        this.cache.set(word, found);
      }
      ids.push(...found);
    }
    return Int32Array.from(ids);
  }

  _merge(symbols) {
    for (;;) {
      let best = -1, rank = Infinity;
      for (let i = 0; i + 1 < symbols.length; i++) {
        const r = this.ranks.get(`${symbols[i]} ${symbols[i + 1]}`);
        if (r !== undefined && r < rank) [best, rank] = [i, r];
      }
      if (best < 0) return symbols;
      const [left, right] = [symbols[best], symbols[best + 1]];
      const merged = [];
      for (let i = 0; i < symbols.length; i++) {
        if (i + 1 < symbols.length && symbols[i] === left && symbols[i + 1] === right) {
          merged.push(left + right);
          i++;
        } else {
          merged.push(symbols[i]);
        }
      }
      symbols = merged;
    }
  }

  decode(ids) {
    const chars = Array.from(ids, (id) => this.tokens.get(Number(id)) || "").join("");
    return new TextDecoder().decode(Uint8Array.from(Array.from(chars, (c) => CHAR_BYTES.get(c) ?? 63)));
  }
}

export class DeviceSet {
  constructor(ort, manifest, session, url) {
    Object.assign(this, { ort, manifest, session, url });
    this.prep = manifest.preprocessing || {};
    this.inputs = manifest.inputs.training;  // the model's inputs, then the targets
    this.batchSize = manifest.batch_size;
    const loss = (manifest.loss && manifest.loss.config) || {};
    this.ignoreIndex = loss.ignore_index ?? -100;
    // The model's output beside the eval loss, read by position: onnxruntime-web 1.19.2 names an eval step's outputs
    // after the training model's, so every one after the loss comes back keyed "undefined".
    this.outputIndex = manifest.outputs.eval.findIndex((o) => o.shape.length >= 2);
    this.output = this.outputIndex >= 0 ? manifest.outputs.eval[this.outputIndex] : null;
  }

  /** "text", "image", or what the manifest names (a table or a custom data builder: example batch only). */
  get kind() { return this.prep.kind; }

  /** The class names an image set was trained with (the run's; "class N" where the manifest names none). */
  get classes() {
    const count = this.output ? this.output.shape[this.output.shape.length - 1] : 0;
    const names = this.prep.classes || [];
    return Array.from({ length: count }, (_, i) => names[i] ?? `class ${i}`);
  }

  _requireKind(kind) {
    if (this.inputs.length !== 2 || this.kind !== kind) {
      throw new DataError(`this set's model was trained on ${this.kind || "custom"} data` +
        `${this.inputs.length !== 2 ? ` with ${this.inputs.length - 1} inputs` : ""}; ` +
        `it cannot train on ${kind === "text" ? "a text file" : "images"}.`);
    }
  }

  // ---- text ----------------------------------------------------------------------------------------------------

  /** The set's tokenizer applied to text (a string, or a file's UTF-8 bytes): token ids. UTF-8 bytes for a `bytes`
   * set, ortflow's byte-level BPE for a `bpe` set (its tokenizer.json, loaded by openSet). */
  encode(text) {
    const kind = this.prep.tokenizer && this.prep.tokenizer.kind;
    if (kind === "bpe" && this.bpe) {
      return this.bpe.encode(typeof text === "string" ? text : new TextDecoder().decode(text));
    }
    if (kind !== "bytes") {
      throw new DataError(`this set's tokenizer is "${kind}"; the page and module tokenize UTF-8 bytes and ortflow's ` +
        "own BPE (data.tokenizer=bytes or bpe). Train the run with one of them to train it here.");
    }
    return typeof text === "string" ? new TextEncoder().encode(text) : text;
  }

  /** Token ids back to text. */
  decode(ids) {
    return this.bpe ? this.bpe.decode(ids) : new TextDecoder().decode(Uint8Array.from(ids));
  }

  /** Windows of the text for training and, from its last `holdout` part, for evaluation. */
  textData(bytes, { holdout = 0.1 } = {}) {
    this._requireKind("text");
    const raw = typeof bytes === "string" ? new TextEncoder().encode(bytes) : bytes;
    if (raw.length === 0) throw new DataError("the text file is empty.");
    if (raw.includes(0)) throw new DataError("the file holds NUL bytes: it looks binary, not text.");
    try {
      new TextDecoder("utf-8", { fatal: true }).decode(raw);
    } catch {
      throw new DataError("the file is not UTF-8 text (it looks binary): pick a text file.");
    }
    const tokens = this.encode(raw);
    const block = this.prep.block_size;
    const least = 2 * (block + 1);
    if (tokens.length < least) {
      throw new DataError(`the text has ${tokens.length} tokens; this set reads windows of ${block} tokens, so it ` +
        `needs at least ${least} (one window to train on and one held out to evaluate).`);
    }
    const split = Math.min(tokens.length - (block + 1), Math.max(block + 1, Math.floor(tokens.length * (1 - holdout))));
    const window = (start) => ({ input: tokens.subarray(start, start + block),
                                 target: tokens.subarray(start + 1, start + block + 1) });
    const evalWindows = Math.floor((tokens.length - split - 1) / block);
    const evaluation = Array.from({ length: evalWindows }, (_, i) => window(split + i * block));
    // Training windows start anywhere in the first part (each is a sample; a batch draws them round a cycle).
    const train = { length: split - block, sample: (i) => window(i) };
    return { train, eval: evaluation, heldOut: { fromToken: split, windows: evalWindows, tokens: tokens.length } };
  }

  /** The language model's continuation of `prompt` (text), `tokens` bytes long, sampled at `temperature`
   * (0: the likeliest byte each time) from a generator seeded with `seed`. */
  async continueText(prompt, { tokens = 120, temperature = 0.8, seed = 0 } = {}) {
    this._requireKind("text");
    const block = this.prep.block_size;
    const random = mulberry32(seed);
    const context = Array.from(this.encode(prompt));
    if (context.length === 0) context.push(...this.encode("\n"));  // an empty prompt starts from a new line
    const made = [];
    for (let n = 0; n < tokens; n++) {
      const window = context.slice(-block);
      const input = new Int32Array(block);
      input.set(window);
      const logits = await this._predict([{ input, target: new Int32Array(block) }]);
      const width = this.output.shape[this.output.shape.length - 1];
      const row = logits.subarray((window.length - 1) * width, window.length * width);
      const next = sample(row, temperature, random);
      context.push(next);
      made.push(next);
    }
    return this.decode(made);
  }

  // ---- images --------------------------------------------------------------------------------------------------

  /** One image (a Blob or File) as the set's input: decoded, resized, centre-cropped and normalised; with the size
   * it had. */
  async prepareImage(blob) {
    const size = this.prep.image_size, resize = this.prep.eval_resize || size;
    const bitmap = await decode(blob);
    const scale = resize / Math.min(bitmap.width, bitmap.height);
    const crop = size / scale;
    const canvas = new OffscreenCanvas(size, size);
    const context = canvas.getContext("2d", { willReadFrequently: true });
    context.imageSmoothingQuality = "high";
    context.drawImage(bitmap.source || bitmap, (bitmap.width - crop) / 2, (bitmap.height - crop) / 2, crop, crop, 0, 0, size, size);
    const rgba = context.getImageData(0, 0, size, size).data;
    const { mean, std } = this.prep.normalize;
    const input = new Float32Array(3 * size * size);
    for (let c = 0; c < 3; c++) {
      for (let p = 0; p < size * size; p++) input[c * size * size + p] = (rgba[p * 4 + c] / 255 - mean[c]) / std[c];
    }
    const original = [bitmap.width, bitmap.height];
    if (bitmap.close) bitmap.close();
    return { input, original };
  }

  /** Images with their labels ([{label, name, blob}], one label per folder) as training and held-out samples: each
   * label's last fifth (by file name, at least one where it has two or more) is held out. Labels that are the
   * set's class names keep their class; other labels take classes 0, 1, ... in sorted order. Unreadable files are
   * left out and listed in `skipped`; images of another size are resized (`resized` counts them). */
  async imageData(files, { holdout = 0.2 } = {}) {
    this._requireKind("image");
    const labels = [...new Set(files.map((f) => f.label))].sort();
    const classes = this.classes;
    if (labels.length < 2) {
      throw new DataError(`the images have ${labels.length ? `one label (${labels[0]})` : "no label"}: put them in ` +
        "one folder per label, at least two labels (a classifier needs two classes to tell apart).");
    }
    if (labels.length > classes.length) {
      throw new DataError(`the images have ${labels.length} labels; this set's model tells ${classes.length} ` +
        "classes apart: use at most that many folders.");
    }
    const byName = labels.every((l) => classes.includes(l));
    const classOf = Object.fromEntries(labels.map((l, i) => [l, byName ? classes.indexOf(l) : i]));
    const train = [], evaluation = [], skipped = [];
    let resized = 0;
    for (const label of labels) {
      const own = files.filter((f) => f.label === label).sort((a, b) => (a.name < b.name ? -1 : a.name > b.name));
      const prepared = [];
      for (const file of own) {
        try {
          const { input, original } = await this.prepareImage(file.blob);
          if (original[0] !== this.prep.image_size || original[1] !== this.prep.image_size) resized++;
          prepared.push({ input, target: classOf[label], name: file.name, label, blob: file.blob });
        } catch {
          skipped.push(file.name);
        }
      }
      const held = prepared.length >= 2 ? Math.max(1, Math.round(prepared.length * holdout)) : 0;
      train.push(...prepared.slice(0, prepared.length - held));
      evaluation.push(...prepared.slice(prepared.length - held));
    }
    const missing = labels.filter((l) => !train.some((s) => s.label === l));
    if (missing.length) {
      throw new DataError(`no readable image to train on for label ${missing.join(", ")}` +
        `${skipped.length ? ` (${skipped.length} unreadable: ${skipped.slice(0, 3).join(", ")})` : ""}.`);
    }
    const names = labels.map((l) => `${l} -> ${classOf[l]}${byName ? "" : ` (was ${classes[classOf[l]]})`}`);
    return { train: { length: train.length, sample: (i) => train[i] }, eval: evaluation, labels: classOf,
             classNames: names, skipped, resized,
             heldOut: evaluation.map((s) => ({ name: s.name, label: s.label, target: s.target })) };
  }

  /** Labels for images (Blobs): [{label, probability, probabilities}], label the user's (from `labels`, the
   * mapping imageData returned) or the set's class name; null in place of a file the browser cannot decode (the
   * others are labelled all the same). */
  async classify(blobs, labels = null) {
    this._requireKind("image");
    const names = this.classes.slice();
    if (labels) for (const [label, id] of Object.entries(labels)) names[id] = label;
    const readable = [];
    for (const [index, blob] of blobs.entries()) {
      try {
        readable.push({ index, sample: { ...(await this.prepareImage(blob)), target: 0 } });
      } catch {
        // left out: null in its place
      }
    }
    const found = blobs.map(() => null);
    for (let i = 0; i < readable.length; i += this.batchSize) {
      const chunk = readable.slice(i, i + this.batchSize);
      const logits = await this._predict(chunk.map((r) => r.sample));
      const width = names.length;
      chunk.forEach(({ index }, k) => {
        const probabilities = softmax(logits.subarray(k * width, (k + 1) * width), 1);
        const best = probabilities.indexOf(Math.max(...probabilities));
        found[index] = { label: names[best], probability: probabilities[best], probabilities };
      });
    }
    return found;
  }

  /** The example batch the export saved (the feeds), which the set's own check trained on. */
  async exampleBatch() {
    const spec = this.manifest.example_batch;
    const folder = new URL(spec.folder.replace(/\/?$/, "/"), this.url);
    const feeds = {};
    for (const input of spec.inputs) {
      const raw = await fetchBytes(new URL(input.file, folder), `the set's example batch ${input.file}`);
      const Type = ARRAYS[input.dtype];
      if (!Type) throw new DataError(`the example batch's ${input.name} is ${input.dtype}, which this module cannot feed.`);
      const values = new Type(raw.buffer, raw.byteOffset, raw.byteLength / Type.BYTES_PER_ELEMENT);
      feeds[input.name] = new this.ort.Tensor(input.dtype, values, input.shape);
    }
    return feeds;
  }

  // ---- batches and steps ---------------------------------------------------------------------------------------

  /** Full training batches for ever: the samples in a shuffled order, reshuffled each time round. */
  *trainingBatches(samples, { seed = 0 } = {}) {
    if (!samples.length) throw new DataError("there is nothing to train on.");
    const random = mulberry32(seed);
    let order = shuffled(samples.length, random), at = 0;
    for (;;) {
      const batch = [];
      while (batch.length < this.batchSize) {
        if (at === order.length) [order, at] = [shuffled(samples.length, random), 0];
        batch.push(samples.sample(order[at++]));
      }
      yield this.feeds(batch);
    }
  }

  /** The graph's feeds for samples ({input, target}); a short batch is padded with zero inputs whose targets the
   * loss ignores. */
  feeds(samples) {
    const [input, target] = this.inputs;
    const rows = this.batchSize;
    const perInput = input.shape.slice(1).reduce((a, b) => a * b, 1);
    const perTarget = target.shape.reduce((a, b) => a * b, 1) / rows;
    const x = new ARRAYS[input.dtype](rows * perInput);
    const y = new ARRAYS[target.dtype](rows * perTarget).fill(cast(target.dtype, this.ignoreIndex));
    samples.forEach((s, r) => {
      const values = s.input, targets = typeof s.target === "number" ? [s.target] : s.target;
      for (let k = 0; k < perInput; k++) x[r * perInput + k] = cast(input.dtype, values[k]);
      for (let k = 0; k < perTarget; k++) y[r * perTarget + k] = cast(target.dtype, targets[k]);
    });
    const Tensor = this.ort.Tensor;
    return { [input.name]: new Tensor(input.dtype, x, input.shape),
             [target.name]: new Tensor(target.dtype, y, target.shape) };
  }

  /** One training step (the gradients, the optimizer's update): the batch's loss. */
  async trainStep(feeds) {
    const loss = scalar(await this.session.runTrainStep(feeds));
    await this.session.runOptimizerStep();
    await this.session.lazyResetGrad();
    return loss;
  }

  /** The eval model over samples (batches of the set's size, the last padded): mean loss over the real targets
   * (the graph's own loss, weighted by each batch's count), and the accuracy of the model's output. */
  async evaluate(samples) {
    if (!samples.length) throw new DataError("nothing was held out to evaluate on.");
    let total = 0, right = 0, count = 0;
    for (let i = 0; i < samples.length; i += this.batchSize) {
      const part = samples.slice(i, i + this.batchSize);
      const feeds = this.feeds(part);
      const outputs = await this.session.runEvalStep(feeds);
      const real = part.reduce((n, s) => n + (typeof s.target === "number" ? 1 : s.target.length), 0);
      total += scalar(outputs) * real;
      count += real;
      if (this.output) {
        const logits = Object.values(outputs)[this.outputIndex].data, width = this.output.shape[this.output.shape.length - 1];
        const targets = feeds[this.inputs[1].name].data;
        for (let r = 0; r < real; r++) {
          const row = logits.subarray(r * width, (r + 1) * width);
          if (row.indexOf(Math.max(...row)) === Number(targets[r])) right++;
        }
      }
    }
    return { loss: total / count, accuracy: this.output ? right / count : null, count };
  }

  /** Every parameter, float32 in the manifest's order, as bytes (what ortflow-import-artifacts reads). */
  async parameters() {
    const flat = await this.session.getContiguousParameters(false);
    return new Uint8Array(flat.data.buffer, flat.data.byteOffset, flat.data.byteLength);
  }

  async _predict(samples) {
    if (!this.output) throw new DataError("this set's eval model returns only its loss: it cannot predict.");
    const outputs = await this.session.runEvalStep(this.feeds(samples));
    return Object.values(outputs)[this.outputIndex].data;
  }
}

async function decode(blob) {
  // In a page an <img> decodes (headless Chromium's virtual time waits for it, not for createImageBitmap); in a
  // worker, createImageBitmap.
  if (typeof Image === "undefined") return createImageBitmap(blob, { premultiplyAlpha: "none" });
  const image = new Image();
  const url = URL.createObjectURL(blob);
  try {
    image.src = url;
    await image.decode();
    return { width: image.naturalWidth, height: image.naturalHeight, source: image };
  } finally {
    URL.revokeObjectURL(url);
  }
}

function cast(dtype, value) {
  return dtype === "int64" ? BigInt(value) : value;
}

export function scalar(outputs) {
  const value = Object.values(outputs)[0].data[0];
  return typeof value === "bigint" ? Number(value) : value;
}

function softmax(row, temperature) {
  const top = Math.max(...row);
  const e = Array.from(row, (v) => Math.exp((v - top) / temperature));
  const sum = e.reduce((a, b) => a + b, 0);
  return e.map((v) => v / sum);
}

function sample(row, temperature, random) {
  if (temperature <= 0) return row.indexOf(Math.max(...row));
  const p = softmax(row, temperature);
  let u = random();
  for (let i = 0; i < p.length; i++) if ((u -= p[i]) <= 0) return i;
  return p.length - 1;
}
