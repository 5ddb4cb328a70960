// AudioWorklet between the playback sources and the speakers: passes the audio through and
// reports what reached the audio graph (frames, non-silent frames, peak) to the page, which
// shows a level and lets a test prove that samples were really played.
class QttsMeter extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frames = 0;
    this.nonzero = 0;
    this.peak = 0;
    this.sinceReport = 0;
  }

  process(inputs, outputs) {
    const input = inputs[0];
    const output = outputs[0];
    if (input && input.length > 0) {
      const x = input[0];
      for (let c = 0; c < output.length; c++) output[c].set(input[Math.min(c, input.length - 1)]);
      let peak = 0;
      let nonzero = 0;
      for (let i = 0; i < x.length; i++) {
        const a = Math.abs(x[i]);
        if (a > 0) nonzero++;
        if (a > peak) peak = a;
      }
      this.frames += x.length;
      this.nonzero += nonzero;
      this.peak = Math.max(this.peak, peak);
      this.sinceReport += x.length;
      if (this.sinceReport >= 1200 && nonzero > 0) {
        this.port.postMessage({ frames: this.frames, nonzero: this.nonzero, peak: this.peak, level: peak });
        this.sinceReport = 0;
      }
    }
    return true;
  }
}

registerProcessor("qtts-meter", QttsMeter);
